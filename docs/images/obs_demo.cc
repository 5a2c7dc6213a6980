// The run behind docs/OBSERVABILITY.md's pictures: a small data-parallel regression (an MLP,
// AdamW, the GradReducer over MPI on CPU processes) recording a timeline, TensorBoard
// scalars and a memory report with this module's APIs. Not part of the build; from the
// repository root after building dtrain_engine:
//   g++ -std=c++17 -O2 docs/images/obs_demo.cc $(for a in engine/*/include; do echo -I$a; done) -Idist/include \
//     -Ioffload/include -isystem $TORCH/include -isystem $TORCH/include/torch/csrc/api/include \
//     -Lbuild/lib -ldtrain_engine -ldtrain_dist -ldtrain_offload -L$TORCH/lib -ltorch \
//     -ltorch_cpu -lc10 -lglog -Wl,-rpath,$PWD/build/lib:$TORCH/lib -o /tmp/obs_demo
//   mpirun -np 2 /tmp/obs_demo /tmp/obs_run
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <tuple>
#include <utility>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/memory/memory_report.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/parallel/grad_norm.h"
#include "dtrain/engine/parallel/reducer.h"
#include "dtrain/engine/observe/tensorboard.h"
#include "dtrain/engine/observe/timeline.h"

using namespace dtrain;
using namespace dtrain::engine;

// The backward pass and the reducer's bucket all-reduces of one step on the timeline.
void record_backward(Timeline& tl, const ReducerStepStats& stats, Timeline::Clock::time_point t_backward,
                     Timeline::Clock::time_point t_returned) {
  tl.add_complete("backward", category::kCompute, lane::kBackward, t_backward, stats.backward_end);
  for (size_t b = 0; b < stats.bucket_launch.size(); ++b) {
    tl.add_instant("launch bucket " + std::to_string(b), category::kComm, lane::kComm, stats.bucket_launch[b],
                   {{"bucket", double(b)}});
  }
  tl.add_complete("all-reduce buckets", category::kComm, lane::kComm, stats.bucket_launch.front(), stats.reduced,
                  {{"bytes", double(stats.bytes)}, {"buckets", double(stats.bucket_launch.size())}});
  tl.add_complete("wait for all-reduce", category::kComm, lane::kMain, stats.backward_end, t_returned);
}

void print_memory_report(const c10::Device& device, const std::vector<at::Tensor>& params, const Optimizer& optimizer,
                         const ActivationProbe& probe, int step, int rank) {
  std::vector<at::Tensor> grads, state;
  for (const auto& p : params) grads.push_back(p.grad());
  for (const auto& [name, t] : optimizer.state()) state.push_back(t);
  MemoryReport r = build_memory_report(device, params, grads, state, probe.start_allocated_mb(), probe.peak_mb());
  r.step = step;
  if (rank == 0) std::printf("%s", r.to_string().c_str());
}

// Each rank's trace, then (rank 0) the merged trace and its overlap summary.
void write_traces(Timeline& traced, dist::Communicator& comm, const dist::World& world, const std::string& out) {
  traced.write(timeline_path_for_rank(out + "/trace.json", world.rank, world.size));
  comm.barrier()->wait();
  if (world.rank != 0) return;
  std::vector<std::string> files;
  for (int r = 0; r < world.size; ++r) files.push_back(timeline_path_for_rank(out + "/trace.json", r, world.size));
  merge_timelines(files, out + "/trace.merged.json");
  std::printf("%s\n", summarize_overlap(read_timeline(out + "/trace.merged.json")).to_string().c_str());
}

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(256, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024),
                               torch::nn::ReLU(), torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                               torch::nn::Linear(1024, 1));
}

ScheduleOptions cosine_schedule(int steps) {
  ScheduleOptions schedule;
  schedule.name = "cosine";
  schedule.warmup_steps = 10;
  schedule.total_steps = steps;
  schedule.min_lr_ratio = 0.1;
  return schedule;
}

void update(Timeline& tl, Optimizer& optimizer, GradReducer& reducer, double lr) {
  Timeline::Span opt(tl, "optimizer step", category::kOptimizer, lane::kOptimizer);
  optimizer.set_lr(lr);
  optimizer.step();
  reducer.zero_grad();
}

// The held-out loss, averaged over the ranks.
double eval_loss(torch::nn::Sequential& model, const at::Tensor& x, const at::Tensor& y, dist::Communicator& comm) {
  torch::NoGradGuard no_grad;
  at::Tensor e = torch::mse_loss(model->forward(x), y);
  comm.all_reduce(e, dist::ReduceOp::kAvg)->wait();
  return e.item<double>();
}

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "/tmp/obs_run";
  const int steps = 150, traced_steps = 8, batch = 64;
  dist::World world = dist::detect_world();
  track_cpu_memory();
  const c10::Device cpu(c10::kCPU);
  auto comm = dist::create_communicator(world.has_mpi_launcher() ? "mpi" : "local", world, cpu);

  torch::manual_seed(0);
  torch::nn::Sequential model = make_model();
  auto params = model->parameters();
  ReducerOptions ro;
  ro.bucket_bytes = 2 << 20;
  GradReducer reducer(params, *comm, ro);
  OptimizerOptions oo;
  oo.lr = 1e-3;
  auto optimizer = make_optimizer(params, oo);
  const ScheduleOptions schedule = cosine_schedule(steps);
  // y = tanh(mean of the first 8 features, scaled) + noise: learnable, with a noise floor.
  auto make_batch = [](int rows) {
    at::Tensor x = torch::randn({rows, 256});
    at::Tensor y =
        torch::tanh(x.narrow(1, 0, 8).sum(1, true) / 2.0) + 0.1 * torch::randn({rows, 1});
    return std::make_pair(x, y);
  };
  torch::manual_seed(999);
  const auto [eval_x, eval_y] = make_batch(512);

  Timeline traced(true, world.rank), off(false, world.rank);
  EventWriter tb(out + "/tensorboard", world.rank == 0);
  torch::manual_seed(1000 + world.rank);  // each rank its own data
  for (int step = 1; step <= steps; ++step) {
    Timeline& tl = step <= traced_steps ? traced : off;
    const auto t_step = Timeline::Clock::now();
    at::Tensor x, y;
    {
      Timeline::Span load(tl, "load batch", category::kData, lane::kLoader, {{"rows", batch}});
      std::tie(x, y) = make_batch(batch);
    }
    ActivationProbe probe(cpu);
    if (step == 3) probe.begin();
    at::Tensor loss;
    {
      Timeline::Span forward(tl, "forward", category::kCompute, lane::kMain);
      loss = torch::mse_loss(model->forward(x), y);
    }
    const auto t_backward = Timeline::Clock::now();
    loss.backward();
    const auto t_returned = Timeline::Clock::now();
    record_backward(tl, reducer.last_step_stats(), t_backward, t_returned);
    if (step == 3) {
      probe.mark("backward");
      print_memory_report(cpu, params, *optimizer, probe, step, world.rank);
    }
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    const double norm = grad_norm(grads).item<double>();
    update(tl, *optimizer, reducer, oo.lr * schedule_factor(schedule, step - 1));
    at::Tensor global = loss.detach().clone();
    comm->all_reduce(global, dist::ReduceOp::kAvg)->wait();
    const auto t_end = Timeline::Clock::now();
    tl.add_complete("step", category::kCompute, lane::kMain, t_step, t_end, {{"step", step}});
    StepMetrics m;
    m.step = step;
    m.loss = global.item<double>();
    m.lr = optimizer->lr();
    m.grad_norm = norm;
    if (step % 25 == 0) m.eval_loss = eval_loss(model, eval_x, eval_y, *comm);
    m.step_ms = std::chrono::duration<double, std::milli>(t_end - t_step).count();
    m.samples_per_s = batch * world.size * 1000.0 / m.step_ms;
    const MemoryStats mem = memory_stats(cpu);
    m.mem_allocated_mb = mem.allocated_mb;
    m.mem_peak_mb = mem.peak_mb;
    tb.add_metrics(m);
  }
  write_traces(traced, *comm, world, out);
  return 0;
}
