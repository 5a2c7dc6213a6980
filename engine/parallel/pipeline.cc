#include "dtrain/engine/parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <map>

#include <ATen/ATen.h>

#include "dtrain/dist/error.h"

namespace dtrain::engine {

PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::k1F1B;
  throw Error("pipeline schedule '" + name + "' does not exist; use gpipe (all forwards, then all backwards) or " +
              "1f1b (one forward, one backward after a warm-up)");
}

const char* to_string(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::kGPipe ? "gpipe" : "1f1b";
}

std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stages, int stage, int micro_batches) {
  DTRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1, "pipeline_actions: stage ", stage,
               " of ", stages, " with ", micro_batches, " micro-batches is not a pipeline step");
  std::vector<PipelineAction> actions;
  const int m = micro_batches;
  if (schedule == PipelineSchedule::kGPipe) {
    for (int i = 0; i < m; ++i) actions.push_back({PipelineAction::kForward, i});
    for (int i = 0; i < m; ++i) actions.push_back({PipelineAction::kBackward, i});
    return actions;
  }
  const int warmup = std::min(stages - 1 - stage, m);
  int next_forward = 0, next_backward = 0;
  for (; next_forward < warmup; ++next_forward) actions.push_back({PipelineAction::kForward, next_forward});
  while (next_forward < m) {  // steady state: one forward, one backward
    actions.push_back({PipelineAction::kForward, next_forward++});
    actions.push_back({PipelineAction::kBackward, next_backward++});
  }
  while (next_backward < m) actions.push_back({PipelineAction::kBackward, next_backward++});
  return actions;
}

PipelineStepResult run_pipeline_step(dist::Communicator& pp, const PipelineStep& step) {
  const int stages = pp.size(), stage = pp.rank();
  const bool first = stage == 0, last = stage == stages - 1;
  const int m = step.micro_batches;
  DTRAIN_CHECK(m >= 1, "pipeline step: micro_batches must be >= 1, got ", m);
  DTRAIN_CHECK(static_cast<bool>(step.forward), "pipeline step: forward is empty; pass the stage's computation");
  DTRAIN_CHECK(!first || static_cast<bool>(step.input), "pipeline step: the first stage needs input(micro)");
  DTRAIN_CHECK(stages == 1 || !step.activation_shape.empty(),
               "pipeline step: activation_shape is empty; the receiving stage must know the activation's shape");
  auto activation = [&] { return at::empty(step.activation_shape, step.activation_options); };

  struct InFlight {
    at::Tensor input;   // what the stage received (requires grad), or the first stage's input
    at::Tensor output;  // the activation sent on, or the last stage's scaled loss
  };
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  const Clock::time_point step_start = Clock::now();
  const double start_mb = step.allocated_mb ? step.allocated_mb() : 0;
  std::map<int, InFlight> held;
  std::vector<dist::WorkPtr> sends;  // in flight (a Work keeps its buffer until it completes)
  PipelineStepResult result;
  at::Tensor loss_sum;  // on the device: read once, after the last micro-batch (no sync per micro-batch)
  for (const PipelineAction& action : pipeline_actions(step.schedule, stages, stage, m)) {
    const int i = action.micro;
    if (action.kind == PipelineAction::kForward) {
      at::Tensor x;
      if (first) {
        x = step.input(i);
      } else {
        x = activation();
        pp.recv(x, stage - 1)->wait();
        x.requires_grad_(true);
      }
      const Clock::time_point compute_start = Clock::now();
      at::Tensor y = step.forward(x, i);
      result.busy_s += seconds(compute_start, Clock::now());
      if (last) {
        DTRAIN_CHECK(y.numel() == 1, "pipeline step: the last stage's forward must return the micro-batch's loss (a ",
                     "scalar), got ", y.sizes());
        const at::Tensor loss = y.detach().to(at::kDouble).reshape({});
        loss_sum = loss_sum.defined() ? loss_sum + loss : loss.clone();
        y = y / m;
      } else {
        const at::ScalarType dtype = c10::typeMetaToScalarType(step.activation_options.dtype());
        DTRAIN_CHECK(y.sizes().vec() == step.activation_shape && y.scalar_type() == dtype, "pipeline step: stage ",
                     stage, " produced ", y.scalar_type(), y.sizes(), " but the pipeline sends ", dtype,
                     c10::IntArrayRef(step.activation_shape),
                     "; every micro-batch's activation must have activation_shape and dtype");
        sends.push_back(pp.send(y.detach().contiguous(), stage + 1));
      }
      held[i] = {x, y};
      result.peak_in_flight = std::max(result.peak_in_flight, static_cast<int>(held.size()));
      if (step.allocated_mb) {
        result.peak_activation_mb = std::max(result.peak_activation_mb, step.allocated_mb() - start_mb);
      }
    } else {
      auto it = held.find(i);
      DTRAIN_CHECK(it != held.end(), "pipeline step: backward of micro-batch ", i, " before its forward");
      InFlight f = std::move(it->second);
      held.erase(it);
      if (last) {
        const Clock::time_point compute_start = Clock::now();
        f.output.backward();
        result.busy_s += seconds(compute_start, Clock::now());
      } else {
        at::Tensor grad = activation();
        pp.recv(grad, stage + 1)->wait();
        const Clock::time_point compute_start = Clock::now();
        f.output.backward(grad);
        result.busy_s += seconds(compute_start, Clock::now());
      }
      if (!first) {
        at::Tensor g = f.input.grad();
        DTRAIN_CHECK(g.defined(), "pipeline step: stage ", stage, "'s forward does not depend on its input; ",
                     "the stage before would get no gradient");
        sends.push_back(pp.send(g.contiguous(), stage - 1));
      }
    }
    result.ran.push_back(action);
    // A completed send's buffer (an activation or its gradient) is no longer needed: drop it
    // now rather than at the end of the step, or 1F1B's memory would grow with m.
    sends.erase(std::remove_if(sends.begin(), sends.end(), [](const dist::WorkPtr& w) { return w->is_completed(); }),
                sends.end());
  }
  for (auto& w : sends) w->wait();
  if (last) result.loss = loss_sum.item<double>() / m;
  result.wall_s = seconds(step_start, Clock::now());
  return result;
}

}  // namespace dtrain::engine
