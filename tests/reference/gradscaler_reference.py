"""Reference for dtrain's LossScaler: PyTorch's GradScaler on planted gradients.

Usage:
  gradscaler_reference.py [STEPS INIT GROWTH BACKOFF INTERVAL INF_STEPS NAN_STEPS]...
      One run per group of seven arguments. INF_STEPS / NAN_STEPS: comma-separated step
      numbers (0-based), or "-" for none. For each step of a run, sets the gradients to planted(step) * current scale (as if backward had
      run on the scaled loss), with an inf / NaN planted on the listed steps, then runs
      scaler.unscale_(opt); scaler.step(opt); scaler.update() and records the scale used,
      whether the optimizer step ran, the unscaled gradients (finite steps only) and the
      scale after update.

The planted gradients must match planted_grads() in tests/unit/amp_test.cc:
  p0 float32 [5]:    (i - 2) * 0.25 + k * 0.125
  p1 float64 [2, 3]: i * 0.5 - 1 + k * 0.0625   (i: flat index)
  p2 float32 [3]:    never has a gradient
  p3 bfloat16 [4]:   i * 0.5 - 0.75 + k * 0.125
  inf step: p0[1] = +inf, p3[2] = -inf;  NaN step: p1[0, 2] = NaN
Output: one JSON object on stdout:
  {"defaults": {init_scale, growth_factor, backoff_factor, growth_interval} of GradScaler,
   "runs": [{"steps": [{step, scale, skipped, unscaled (finite steps), scale_after}, ...]}]}
"""
import json
import sys

import torch


def planted_grads(k, scale, inf, nan):
    g0 = torch.arange(5, dtype=torch.float32)
    g0 = (g0 - 2) * 0.25 + k * 0.125
    g1 = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    g1 = g1 * 0.5 - 1 + k * 0.0625
    g3 = torch.arange(4, dtype=torch.float32)
    g3 = (g3 * 0.5 - 0.75 + k * 0.125).to(torch.bfloat16)
    g0, g1, g3 = g0 * scale, g1 * scale, g3 * scale
    if inf:
        g0[1] = float("inf")
        g3[2] = float("-inf")
    if nan:
        g1[0, 2] = float("nan")
    return g0, g1, g3


def parse_steps(text):
    return set() if text == "-" else {int(s) for s in text.split(",")}


class CountingSGD(torch.optim.SGD):
    """SGD that counts the steps GradScaler lets through."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.steps_taken = 0

    def step(self, closure=None):
        self.steps_taken += 1
        return super().step(closure)


def sequence(argv):
    steps, init, growth, backoff, interval = (int(argv[0]), float(argv[1]), float(argv[2]),
                                               float(argv[3]), int(argv[4]))
    inf_steps, nan_steps = parse_steps(argv[5]), parse_steps(argv[6])
    p0 = torch.zeros(5, dtype=torch.float32, requires_grad=True)
    p1 = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    p2 = torch.zeros(3, dtype=torch.float32, requires_grad=True)
    p3 = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    opt = CountingSGD([p0, p1, p2, p3])
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth,
                                  backoff_factor=backoff, growth_interval=interval)
    records = []
    for k in range(steps):
        # scale() of a unit loss gives the current scale (and starts the scaler, as in training).
        scale = scaler.scale(torch.ones((), dtype=torch.float32)).item()
        g0, g1, g3 = planted_grads(k, scale, k in inf_steps, k in nan_steps)
        p0.grad, p1.grad, p2.grad, p3.grad = g0, g1, None, g3
        scaler.unscale_(opt)
        before = opt.steps_taken
        scaler.step(opt)
        skipped = opt.steps_taken == before
        rec = {"step": k, "scale": scale, "skipped": skipped}
        if not skipped:
            rec["unscaled"] = {
                "p0": p0.grad.tolist(),
                "p1": p1.grad.flatten().tolist(),
                "p3": p3.grad.float().tolist(),
            }
        scaler.update()
        rec["scale_after"] = scaler.get_scale()
        records.append(rec)
    return {"steps": records}


def main():
    args = sys.argv[1:]
    if len(args) % 7 != 0:
        raise SystemExit("expected groups of 7 arguments; see the docstring")
    d = torch.amp.GradScaler("cpu")
    out = {
        "defaults": {"init_scale": d.get_scale(), "growth_factor": d.get_growth_factor(),
                     "backoff_factor": d.get_backoff_factor(),
                     "growth_interval": d.get_growth_interval()},
        "runs": [sequence(args[i:i + 7]) for i in range(0, len(args), 7)],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
