// dtrain-bench context_parallel: activation memory per rank of a GPT block (causal attention and
// MLP) at sequence length S when a context-parallel group of C ranks splits the sequence
// (--cp of train_gpt: ring attention over the group). For every C that divides the world (the
// world cut into groups of C consecutive ranks, each group computing the same) and every S:
//   held_bytes       what the block's forward keeps for backward, its output included: the
//                    tensors allocated during the forward and still alive after it (exact on
//                    the CPU: dtrain's counting allocator), on rank 0 of the group;
//   attention_bytes  the same for the attention layer alone;
//   peak_bytes       the peak above the forward's start during forward and backward;
//   seconds          forward and backward of the block (one run after a warm-up at the smallest S).
// C = 1 runs the plain block (scaled_dot_product_attention), as the model does without --cp.
//   mpirun -np 4 dtrain-bench context_parallel --cp_seqs=1024,4096,16384 --cp_d_model=64 --cp_heads=2
#include <gflags/gflags.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "bench.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/parallel/context_parallel.h"

DEFINE_string(cp_seqs, "1024,2048,4096,8192,16384", "context_parallel: sequence lengths (multiples of 2 x the world size)");
DEFINE_int64(cp_d_model, 64, "context_parallel: the block's width");
DEFINE_int64(cp_heads, 2, "context_parallel: attention heads");
DEFINE_int64(cp_batch, 1, "context_parallel: sequences per micro-batch");

namespace dtrain::bench {
namespace {

int64_t allocated_bytes() {
  return std::llround(engine::memory_stats(c10::Device(c10::kCPU)).allocated_mb * engine::kBytesPerMiB);
}
int64_t peak_bytes() { return std::llround(engine::memory_stats(c10::Device(c10::kCPU)).peak_mb * engine::kBytesPerMiB); }

struct Point {
  int64_t held = 0, attention = 0, peak = 0;
  double seconds = 0;
};

// One forward and backward of `block` on this rank's part of a seeded [B, S, d] input.
Point measure(engine::GptBlockImpl& block, dist::Communicator& cp, int64_t S) {
  const int64_t d = FLAGS_cp_d_model;
  at::manual_seed(7);
  at::Tensor whole = at::randn({FLAGS_cp_batch, S, d});
  at::Tensor x = (cp.size() > 1 ? engine::cp_split_sequence(whole, 1, cp.rank(), cp.size()) : whole).requires_grad_();
  whole = at::Tensor();
  Point p;
  {
    const int64_t before = allocated_bytes();
    at::Tensor a = block.attn->forward(block.ln1->forward(x));
    p.attention = allocated_bytes() - before;
  }
  cp.barrier()->wait();
  const int64_t before = allocated_bytes();
  engine::reset_peak_memory(c10::Device(c10::kCPU));
  const auto start = std::chrono::steady_clock::now();
  at::Tensor y = block.forward(x);
  p.held = allocated_bytes() - before;
  (y * y).sum().backward();
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  p.peak = peak_bytes() - before;
  return p;
}

}  // namespace

int run_context_parallel(BenchContext& ctx) {
  DTRAIN_CHECK(engine::cpu_memory_tracked(), "context_parallel: CPU memory is not counted (DTRAIN_TRACK_CPU_MEMORY=0); "
               "unset it");
  DTRAIN_CHECK(ctx.device.is_cpu(), "context_parallel counts CPU tensor memory: run it with --device=cpu");
  std::vector<int64_t> seqs;
  std::stringstream list(FLAGS_cp_seqs);
  for (std::string item; std::getline(list, item, ',');) seqs.push_back(std::stoll(item));
  const int W = ctx.comm->size(), r = ctx.comm->rank();
  for (int64_t S : seqs) {
    DTRAIN_CHECK(S > 0 && S % (2 * W) == 0, "--cp_seqs: ", S, " is not a multiple of 2 x the world size ", W);
  }
  auto alone = ctx.comm->split(r, 0, "alone");
  for (int C = 1; C <= W; C *= 2) {
    if (W % C != 0) continue;
    auto cp = ctx.comm->split(r / C, r % C, "cp" + std::to_string(C));
    for (int64_t S : seqs) {
      engine::GptOptions o;
      o.vocab = 8;
      o.d_model = FLAGS_cp_d_model;
      o.heads = FLAGS_cp_heads;
      o.ff = 4 * o.d_model;
      o.seq_len = S;
      o.layers = 1;
      at::manual_seed(1);
      engine::GptBlockImpl block(o, *alone, C > 1 ? cp.get() : nullptr);
      if (S == seqs.front()) measure(block, *cp, S);  // warm-up: the first use's one-time allocations
      block.zero_grad();
      const Point p = measure(block, *cp, S);
      if (r == 0) {
        nlohmann::json row{{"bench", "context_parallel"}, {"cp", C}, {"seq", S}, {"tokens_per_rank", S / C},
                           {"d_model", o.d_model}, {"heads", o.heads}, {"batch", FLAGS_cp_batch},
                           {"held_bytes", p.held}, {"attention_bytes", p.attention}, {"peak_bytes", p.peak},
                           {"seconds", p.seconds}};
        std::printf("%s\n", row.dump().c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace dtrain::bench
