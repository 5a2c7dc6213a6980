"""Why the host work of --offload=layers runs slowly on the GPU machine: times the CPU operations
that the layer-offload profile found (the gradient accumulation into host .grad tensors, the norm
over them) on gpt124m's block sizes, once directly on the main thread and once as autograd runs
them (AccumulateGrad of CPU parameters whose gradients a custom backward brings back from the
GPU). Prints one line per measurement. Usage: python3 tools/gpu_host_ops_probe.py"""
import time

import torch

D, F, BLOCKS = 768, 3072, 12
SHAPES = [(3 * D, D), (3 * D,), (D, D), (D,), (F, D), (F,), (D, F), (D,), (D,), (D,), (D,), (D,)]


def ms(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    threads0 = torch.get_num_threads()
    print(f"torch {torch.__version__}: {threads0} intra-op threads, "
          f"{torch.get_num_interop_threads()} inter-op")
    params = [torch.nn.Parameter(torch.randn(s, pin_memory=True)) for _ in range(BLOCKS) for s in SHAPES]
    n = sum(p.numel() for p in params)
    grads = [torch.randn(p.shape, pin_memory=True) for p in params]
    for p in params:
        p.grad = torch.zeros(p.shape, pin_memory=True)
    t = ms(lambda: [p.grad.add_(g) for p, g in zip(params, grads)])
    print(f"add_ into host .grad, main thread: {t:.1f} ms for {n / 1e6:.1f}M floats "
          f"({3 * 4 * n / t / 1e6:.1f} GB/s)")
    t = ms(lambda: torch._foreach_norm([p.grad for p in params]))
    print(f"_foreach_norm of host grads: {t:.1f} ms ({4 * n / t / 1e6:.1f} GB/s)")
    for threads in (1, 4):
        torch.set_num_threads(threads)
        t1 = ms(lambda: [p.grad.add_(g) for p, g in zip(params, grads)])
        print(f"  with {threads} thread(s): add_ {t1:.1f} ms")
    torch.set_num_threads(threads0)

    dev = [g.cuda() for g in grads]

    class Back(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *ps):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            out = []
            for d in dev:
                h = torch.empty(d.shape, pin_memory=True)
                h.copy_(d, non_blocking=True)
                out.append(h)
            torch.cuda.current_stream().synchronize()
            return (g, *out)

    x = torch.randn(4, device="cuda", requires_grad=True)

    def backward():
        Back.apply(x, *params).sum().backward()
        torch.cuda.synchronize()

    t = ms(backward)
    print(f"autograd: D2H copies + AccumulateGrad into host .grad: {t:.1f} ms")
    with torch.autograd.profiler.profile() as prof:
        backward()
    for e in prof.key_averages():
        if e.key in ("aten::add_", "torch::autograd::AccumulateGrad", "aten::copy_"):
            print(f"  profile: {e.key} {e.cpu_time_total / 1e3:.1f} ms in {e.count} calls")


if __name__ == "__main__":
    main()
