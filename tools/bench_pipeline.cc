// dtrain-bench pipeline: a stack of MLP blocks split into consecutive stages over the ranks
// (pp = the world size), one step per schedule (gpipe, 1f1b, zb, interleaved over --pp_chunks chunks
// per rank) and micro-batch count. Prints per stage the
// micro-batches held at once, the activation memory held above the step's start (exact on the
// CPU), and the idle fraction (1 - compute / step) against the bubble's theory (each stage's
// idle share when the schedule's lists run on the model of the pipeline: simulate_pipeline);
// then the same global batch data-parallel (every rank the whole stack,
// m / P micro-batches each, gradients all-reduced) for the step-time comparison.
//   mpirun -np 2 dtrain-bench pipeline --pp_layers=8 --pp_width=512 --pp_rows=256
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/linear.h>

#include "bench.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/parallel/pipeline.h"

DEFINE_int32(pp_layers, 8, "pipeline: blocks in the whole stack (split evenly over the ranks)");
DEFINE_int64(pp_width, 512, "pipeline: block width (the activation's last dimension)");
DEFINE_int64(pp_rows, 256, "pipeline: rows per micro-batch");
DEFINE_string(pp_micro, "1,2,4,8,16", "pipeline: micro-batch counts to run");
DEFINE_int32(pp_iters, 3, "pipeline: timed steps per point (after one warm-up step)");
DEFINE_int32(pp_chunks, 2, "pipeline: model chunks per rank of the interleaved schedule (0: skip it)");

namespace dtrain::bench {
namespace {

struct Block {
  torch::nn::Linear up{nullptr}, down{nullptr};
  at::Tensor forward(const at::Tensor& x) { return x + down->forward(at::gelu(up->forward(x))); }
};

std::vector<Block> make_blocks(int begin, int end) {
  std::vector<Block> blocks;
  for (int b = begin; b < end; ++b) {
    at::manual_seed(b);
    blocks.push_back({torch::nn::Linear(FLAGS_pp_width, 4 * FLAGS_pp_width), torch::nn::Linear(4 * FLAGS_pp_width, FLAGS_pp_width)});
  }
  return blocks;
}

at::Tensor micro_input(int i) {
  at::manual_seed(10000 + i);
  return at::randn({FLAGS_pp_rows, FLAGS_pp_width});
}

// Every rank's values of `mine`, rank by rank.
std::vector<std::vector<double>> gather(dist::Communicator& comm, const std::vector<double>& mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  at::Tensor out = at::empty({comm.size() * n}, at::kDouble);
  comm.all_gather(at::tensor(mine, at::kDouble), out)->wait();
  std::vector<std::vector<double>> all(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    for (int64_t k = 0; k < n; ++k) all[r].push_back(out[r * n + k].item<double>());
  }
  return all;
}

// One row per schedule and micro-batch count: each stage's idle fraction, activation memory
// and micro-batches in flight against the bubble's theory.
void pipeline_rows(BenchContext& ctx, std::vector<Block>& blocks, const std::vector<int>& micro) {
  dist::Communicator& comm = *ctx.comm;
  const int stages = comm.size(), s = comm.rank();
  const bool last = s == stages - 1;
  // Interleaved: chunk c of this rank is virtual stage c P + s, holding blocks
  // [(c P + s) b, (c P + s + 1) b) of b = layers / (v P) each.
  const int v = FLAGS_pp_chunks;
  std::vector<std::vector<Block>> chunks;
  if (v >= 2 && stages >= 2) {
    DTRAIN_CHECK(FLAGS_pp_layers % (v * stages) == 0, "--pp_layers=", FLAGS_pp_layers, " must be a multiple of ",
                 "--pp_chunks x the ranks (", v * stages, ") for the interleaved schedule, or set --pp_chunks=0");
    const int b = FLAGS_pp_layers / (v * stages);
    for (int c = 0; c < v; ++c) chunks.push_back(make_blocks((c * stages + s) * b, (c * stages + s + 1) * b));
  }
  for (engine::PipelineSchedule schedule : {engine::PipelineSchedule::kGPipe, engine::PipelineSchedule::k1F1B,
                                            engine::PipelineSchedule::kZeroBubble, engine::PipelineSchedule::kInterleaved}) {
    const bool interleaved = schedule == engine::PipelineSchedule::kInterleaved;
    if (interleaved && chunks.empty()) continue;
    for (int m : micro) {
      if (interleaved && m % stages != 0) continue;  // its micro-batches go P at a time
      engine::PipelineStep step;
      step.micro_batches = m;
      step.schedule = schedule;
      if (interleaved) {
        step.chunks = v;
        step.chunk_forward = [&](const at::Tensor& x, int, int c) {
          at::Tensor h = x;
          for (Block& blk : chunks[static_cast<size_t>(c)]) h = blk.forward(h);
          return last && c == v - 1 ? h.pow(2).mean() : h;
        };
      }
      step.activation_shape = {FLAGS_pp_rows, FLAGS_pp_width};
      step.activation_options = at::TensorOptions().dtype(at::kFloat);
      step.input = micro_input;
      step.allocated_mb = [&] { return engine::memory_stats(ctx.device).allocated_mb; };
      step.forward = [&](const at::Tensor& x, int) {
        at::Tensor h = x;
        for (Block& b : blocks) h = b.forward(h);
        return last ? h.pow(2).mean() : h;
      };
      std::vector<double> walls, idle, peak_mb, in_flight;
      for (int it = 0; it <= FLAGS_pp_iters; ++it) {
        comm.barrier()->wait();
        const engine::PipelineStepResult r = engine::run_pipeline_step(comm, step);
        if (it == 0) continue;  // warm-up
        walls.push_back(r.wall_s);
        idle.push_back(1 - r.busy_s / r.wall_s);
        peak_mb.push_back(r.peak_activation_mb);
        in_flight.push_back(r.peak_in_flight);
      }
      const auto all = gather(comm, {median(walls), median(idle), median(peak_mb), median(in_flight)});
      if (s == 0) {
        // The theory: the schedule's lists on the model of the pipeline at equal costs of a
        // forward and each half of a backward (1F1B and GPipe: (P - 1) / (m + P - 1) each).
        const engine::SimulatedPipeline theory =
            engine::simulate_pipeline(schedule, stages, m, {}, interleaved ? v : 1);
        nlohmann::json row{{"bench", "pipeline"}, {"schedule", engine::to_string(schedule)}, {"stages", stages},
                           {"micro_batches", m}, {"bubble_theory", theory.idle_share}};
        if (interleaved) row["chunks"] = v;
        double step_ms = 0;
        for (int r = 0; r < stages; ++r) {
          step_ms = std::max(step_ms, 1e3 * all[r][0]);
          row["idle_fraction"].push_back(all[r][1]);
          row["activation_mb"].push_back(all[r][2]);
          row["in_flight"].push_back(static_cast<int>(all[r][3]));
        }
        row["step_ms"] = step_ms;
        std::printf("%s\n", row.dump().c_str());
        std::fflush(stdout);
      }
    }
  }
}

// Data parallelism at the same global batch: the whole stack on every rank, m / P micro-batches
// each, the gradients all-reduced.
void data_parallel_rows(BenchContext& ctx, const std::vector<int>& micro) {
  dist::Communicator& comm = *ctx.comm;
  const int stages = comm.size(), s = comm.rank();
  std::vector<Block> whole = make_blocks(0, FLAGS_pp_layers);
  std::vector<at::Tensor> params;
  for (Block& b : whole) {
    for (auto* l : {&b.up, &b.down}) {
      for (auto& p : (*l)->parameters()) params.push_back(p);
    }
  }
  for (int m : micro) {
    if (m % stages != 0) continue;
    std::vector<double> walls;
    for (int it = 0; it <= FLAGS_pp_iters; ++it) {
      comm.barrier()->wait();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = s; i < m; i += stages) {
        at::Tensor h = micro_input(i);
        for (Block& b : whole) h = b.forward(h);
        (h.pow(2).mean() / m).backward();
      }
      at::Tensor flat = at::cat([&] {
        std::vector<at::Tensor> g;
        for (auto& p : params) g.push_back(p.grad().view(-1));
        return g;
      }());
      comm.all_reduce(flat)->wait();
      for (auto& p : params) p.mutable_grad().zero_();
      if (it > 0) walls.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const auto all = gather(comm, {median(walls)});
    if (s == 0) {
      double step_ms = 0;
      for (auto& v : all) step_ms = std::max(step_ms, 1e3 * v[0]);
      nlohmann::json row{{"bench", "pipeline"}, {"schedule", "dp"}, {"ranks", stages}, {"micro_batches", m},
                         {"step_ms", step_ms}};
      std::printf("%s\n", row.dump().c_str());
      std::fflush(stdout);
    }
  }
}

}  // namespace

int run_pipeline(BenchContext& ctx) {
  dist::Communicator& comm = *ctx.comm;
  const int stages = comm.size(), s = comm.rank();
  DTRAIN_CHECK(FLAGS_pp_layers >= stages && FLAGS_pp_layers % stages == 0, "--pp_layers=", FLAGS_pp_layers,
               " must be a multiple of the ranks (", stages, "): each stage gets as many blocks");
  DTRAIN_CHECK(ctx.device.is_cpu(), "dtrain-bench pipeline runs on the CPU (--device=cpu)");
  DTRAIN_CHECK(FLAGS_pp_iters >= 1 && FLAGS_pp_rows >= 1 && FLAGS_pp_width >= 1, "--pp_iters, --pp_rows, --pp_width >= 1");
  std::vector<int> micro;
  std::stringstream list(FLAGS_pp_micro);
  for (std::string item; std::getline(list, item, ',');) micro.push_back(std::stoi(item));
  const int per = FLAGS_pp_layers / stages;
  std::vector<Block> blocks = make_blocks(s * per, (s + 1) * per);
  pipeline_rows(ctx, blocks, micro);
  data_parallel_rows(ctx, micro);
  return 0;
}

}  // namespace dtrain::bench
