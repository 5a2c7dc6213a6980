// dtrain-bench: benchmarks that print JSON lines. Usage: dtrain-bench BENCH [--flags]
//   allreduce   Communicator all-reduce vs the backend's raw call, 1 KiB .. 256 MiB
//   engine      Trainer step vs a hand-written libtorch loop at world size 1
//   cpu_adam    CPU AdamW step: dtrain's CpuOptimizer vs PyTorch's fused and foreach AdamW,
//               and the machine's memory bandwidth (--params, --threads, --iters, --warmup)
//   host_norm   the clipping norm of host gradients (layer offload's): dtrain's threaded pieces vs
//               ATen's _foreach_norm (--params, --tensor_elems, --threads, --iters)
//   sparse      an embedding's sparse gradient averaged by row exchange vs densified and
//               all-reduced, over touched rows per rank (--vocab, --dim): the dense fallback's constant
//   pipeline    a block stack split into stages over the ranks, GPipe and 1F1B per micro-batch
//               count: activation memory and idle fraction per stage, and data parallelism's step
//   context_parallel  a GPT block's activation memory per rank over sequence lengths, for each
//               context-parallel size C dividing the world (exact on the CPU)
//   fused_ce    CUDA: forward + backward of the mean cross-entropy over [8192, 32000] bf16 logits,
//               dtrain's fused kernels vs the ATen composition (--ce_rows, --ce_vocab, --ce_dtype)
//   fused_block CUDA: a GPT block's residual LayerNorm and bias + GELU, forward + backward, dtrain's
//               fused kernels vs the ATen ops they replace (--fb_rows, --fb_dmodel, --fb_ff)
#include <gflags/gflags.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <map>

#include "bench.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/logging.h"

DEFINE_string(backend, "auto", "communicator backend: auto, mpi, nccl, local");
DEFINE_string(device, "cpu", "device of the buffers: cpu, cuda or auto");
DEFINE_int32(collective_timeout_s, 300, "seconds before a stuck collective ends the run");

int main(int argc, char** argv) {
  using namespace dtrain;
  const std::map<std::string, std::function<int(bench::BenchContext&)>> benches = {
      {"allreduce", bench::run_allreduce},
      {"engine", bench::run_engine},
      {"cpu_adam", bench::run_cpu_adam},
      {"host_norm", bench::run_host_norm},
      {"sparse", bench::run_sparse},
      {"pipeline", bench::run_pipeline},
      {"fused_ce", bench::run_fused_ce},
      {"fused_block", bench::run_fused_block},
      {"context_parallel", bench::run_context_parallel},
  };
  gflags::SetUsageMessage("dtrain-bench BENCH [flags]; BENCH is one of: allreduce, engine, cpu_adam, host_norm, sparse, pipeline, fused_ce, fused_block, context_parallel");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (argc < 2 || !benches.count(argv[1])) {
    std::fprintf(stderr, "dtrain-bench: name a benchmark: %s BENCH [flags], BENCH one of:", argv[0]);
    for (auto& [name, fn] : benches) std::fprintf(stderr, " %s", name.c_str());
    std::fprintf(stderr, "\n");
    return kExitUsage;
  }
  try {
    bench::BenchContext ctx;
    ctx.world = dist::detect_world();
    dist::init_logging(argv[0], ctx.world);
    ctx.device = dist::select_device(ctx.world, dist::parse_device_request(FLAGS_device));
    dist::CommOptions options;
    DTRAIN_CHECK(FLAGS_collective_timeout_s > 0, "--collective_timeout_s must be positive");
    options.timeout = std::chrono::seconds(FLAGS_collective_timeout_s);
    ctx.comm = dist::create_communicator(FLAGS_backend, ctx.world, ctx.device, options);
    return benches.at(argv[1])(ctx);
  } catch (const Error& e) {
    std::fprintf(stderr, "dtrain-bench: %s\n", e.what());
    return exit_code_of(e);
  }
}
