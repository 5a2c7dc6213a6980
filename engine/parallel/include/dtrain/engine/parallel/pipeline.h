// Pipeline parallelism's core: one stage of a model split into P consecutive stages on the P
// ranks of a pipeline communicator, running a step's micro-batches by a schedule.
//
// Each micro-batch flows forward through the stages (the activation sent from stage s to s+1)
// and its gradient flows back (from s+1 to s). The first stage reads its input from the batch;
// the last computes the loss, scaled by 1 / micro-batches so that the gradients are those of
// the mean loss, as with --accum_steps. Schedules (the order of a stage's forwards F and
// backwards B):
//   gpipe  every forward, then every backward: a stage holds all m micro-batches' activations.
//   1f1b   after a warm-up of min(P - 1 - s, m) forwards, one forward and one backward in turn,
//          then the remaining backwards (Megatron's default): stage s holds at most
//          min(P - s, m) micro-batches' activations.
//   zb     zero bubble (ZB-H1's memory bound; Qi et al., 2023): each backward is split into its
//          input-gradient half B, which the stage before waits for, and its weight-gradient
//          half W (split_backward.h), which no stage waits for and which fills the bubble.
//          The order is a list schedule of the whole pipeline at unit costs (F = B = W); given
//          the stage's costs (PipelineStep::costs), the lists of the schedule at those costs, at
//          unit costs or half way, whichever simulates fastest at the costs. A free
//          stage runs a ready B, else a ready F while it holds fewer than min(P, m)
//          micro-batches (1f1b's first stage's bound, on every stage), else its oldest pending
//          W. A micro-batch's activations are held until its W. At unit costs its step is
//          the ideal 3m + (P - 1) units plus at most max(P - m, 4) for P <= 8 (1f1b:
//          3m + 3 (P - 1)); simulate_pipeline() says exactly.
//   interleaved  interleaved 1F1B (Megatron-LM's virtual stages; Narayanan et al., 2021): each
//          rank holds v chunks of the model (PipelineStep::chunks), rank s chunk c being virtual
//          stage c P + s of v P, so a micro-batch goes round the ring of ranks v times and the
//          bubble shrinks to (P - 1) / (v m) of the step. Megatron's order: forwards and
//          backwards go through the chunks P micro-batches at a time, after a warm-up of
//          2 (P - 1 - s) + (v - 1) P forwards. m must be a multiple of P.
// All leave the same gradients in the stage's parameters (.grad accumulates, as autograd
// does), equal to one process running the whole model on the same micro-batches (zb: summed
// in another order, equal to rounding).
//
// Transport: Communicator::send/recv on the pipeline communicator (its rank = the stage). The
// activations' shape and dtype are fixed per step (the receiver must know them): pass them in
// PipelineStep. Sends are asynchronous (the next computation overlaps them); receives wait.
// A sent tensor is held until its send completes (by the step, and by the send's Work).
// Each action's send is issued together with the next action's receive, as one group
// (CommGroup): on NCCL, whose operations run in issue order on its stream, a send of stage s
// left alone could wait behind a receive that needs a send its neighbour has queued behind its
// own receive from s, a cycle that large activations would turn into a hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/communicator.h"

namespace dtrain::engine {

enum class PipelineSchedule { kGPipe, k1F1B, kZeroBubble, kInterleaved };
// "gpipe", "1f1b" or "zb"; anything else is a dtrain::Error naming them (kInterleaved runs in
// run_pipeline_step, but the Trainer does not split a model into chunks yet).
PipelineSchedule parse_pipeline_schedule(const std::string& name);
const char* to_string(PipelineSchedule schedule);

struct PipelineAction {
  // kBackward: the whole backward; kBackwardInput and kBackwardWeight: its two halves (zb).
  enum Kind { kForward, kBackward, kBackwardInput, kBackwardWeight };
  Kind kind;
  int micro;      // 0 .. micro_batches - 1
  int chunk = 0;  // the model chunk (interleaved: 0 .. chunks - 1; virtual stage chunk * P + stage)
  bool operator==(const PipelineAction& o) const { return kind == o.kind && micro == o.micro && chunk == o.chunk; }
};

// The time of one action of a stage: a forward, the input-gradient half B of a backward and its
// weight-gradient half W (a whole backward costs B + W). Unit costs by default.
struct PipelineCosts {
  double forward = 1, backward_input = 1, backward_weight = 1;
};
// "F,B,W" (three positive numbers, e.g. "1,1.3,0.7"); dtrain::Error naming --pp_zb_costs otherwise.
PipelineCosts parse_pipeline_costs(const std::string& text);
// "F,B,W" with up to 3 significant digits (what --pp_zb_costs takes), scaled so that F is 1.
std::string pipeline_costs_text(const PipelineCosts& costs);

// Stage `stage` of `stages`: its actions for `micro_batches` micro-batches, in the order the
// schedule runs them. A micro-batch's forward comes before its backward (halves: B before W).
// chunks: the model chunks per stage, 1 except for interleaved (>= 2). costs: zb only, the
// costs its list schedule is ordered at (the stage's measured F, B and W, in any unit: their
// ratios matter; every stage must be given the same); unit costs give the lists described above.
// dtrain::Error for an interleaved step whose micro-batches are not a multiple of the stages,
// or with one stage or chunk, naming the fix, and for costs that are not positive.
std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stages, int stage, int micro_batches,
                                             int chunks = 1, const PipelineCosts& costs = {});

// How a stage groups its messages (PipelineStep's transport): before action k of its list it
// issues one group (CommGroup) holding every send the actions since the last group produced and
// the receives of the actions in receives[k] (a group with nothing in it is not issued); then it
// waits for those receives. issue[k] false: no group before action k. gpipe, 1f1b and zb: a group
// before every action, receiving that action's message. interleaved (Megatron-LM's batched
// exchanges): a forward followed by a backward share one group, before the forward, receiving
// both their messages; none between them (except where every forward precedes every backward,
// m = P: there a group before every action, as for 1f1b). Sends are issued in the order they were produced,
// receives in list order. `list` is pipeline_actions(schedule, stages, stage, m, chunks).
struct PipelineExchangePlan {
  std::vector<bool> issue;
  std::vector<std::vector<int>> receives;
};
PipelineExchangePlan pipeline_exchange_plan(PipelineSchedule schedule, const std::vector<PipelineAction>& list,
                                            int stages, int stage, int chunks = 1);

// Every stage's actions run against each other on a model of the pipeline: a forward waits
// for the stage before's forward of the same micro-batch, a backward (or B) for the stage
// after's backward (or B) (the last stage's for its own forward), a W for its B, where "before"
// and "after" are virtual stages when the lists hold chunks (chunk c of stage s is virtual stage
// c P + s: the one before chunk c of stage 0 is chunk c - 1 of stage P - 1); a stage runs
// its list in order, each action as soon as the stage is free and what it waits for is done
// (messages take no time). The costs are per action: forward, B and W (a whole backward costs
// B + W). Throws dtrain::Error naming the stage and action for lists that would deadlock, or
// that miss, repeat or misorder an action.
struct SimulatedPipeline {
  double step = 0;                 // the last action's end
  std::vector<double> busy;        // per stage: the time it computes
  std::vector<double> idle_share;  // per stage: 1 - busy / step
  std::vector<int> peak_in_flight; // per stage: the most micro-batches whose activations it held
};
SimulatedPipeline simulate_pipeline(const std::vector<std::vector<PipelineAction>>& stages, int micro_batches,
                                    const PipelineCosts& costs = {});
// simulate_pipeline of the schedule's lists for every stage (the costs per chunk). zb: the lists
// ordered at *order_costs (null: unit costs, the runtime's default; pass &costs for the lists a
// step given its costs runs, PipelineStep::costs).
SimulatedPipeline simulate_pipeline(PipelineSchedule schedule, int stages, int micro_batches,
                                    const PipelineCosts& costs = {}, int chunks = 1,
                                    const PipelineCosts* order_costs = nullptr);

// How a stack of `blocks` blocks is cut into `stages` consecutive stages: the first block of
// each stage and, last, `blocks` (stages + 1 entries; stage s holds [b[s], b[s+1])).
//   counts ("a,b,...", --pp_blocks) empty: blocks / stages each, and the remainder one more each
//     to stages 1, 2, ... (never to the first stage, which also holds the embeddings; to the
//     last, which holds the head and the loss, only when every middle stage has one more).
//   counts given: those numbers of blocks, one per stage, each >= 1, summing to `blocks` (e.g.
//     2,4,4,2 gives the first and last stages fewer).
// dtrain::Error naming the numbers for fewer blocks than stages or counts that do not fit.
std::vector<int> pipeline_stage_bounds(int blocks, int stages, const std::string& counts = "");

// One step of one stage.
struct PipelineStep {
  int micro_batches = 1;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  // Model chunks on this stage (interleaved: >= 2, and chunk_forward instead of forward).
  int chunks = 1;
  // zb: the F, B and W costs its lists are ordered at (pipeline_actions); the same on every stage.
  PipelineCosts costs;
  // The activation a stage sends to the next (and the gradient it gets back): its shape and
  // dtype, the same for every micro-batch; device: the stage's.
  std::vector<int64_t> activation_shape;
  at::TensorOptions activation_options;
  // First stage only: micro-batch i's input to the stage.
  std::function<at::Tensor(int micro)> input;
  // The stage's computation: the first stage gets input(i), the others the activation
  // received from the stage before. The last stage returns micro-batch i's loss (a scalar,
  // its mean over the micro-batch's rows); the others the activation to send on.
  std::function<at::Tensor(const at::Tensor& x, int micro)> forward;
  // With chunks > 1: the computation of one chunk (virtual stage chunk * P + stage). The first
  // virtual stage (chunk 0 of stage 0) gets input(i), the last (chunk chunks - 1 of stage P - 1)
  // returns the loss; every other chunk the activation, of activation_shape.
  std::function<at::Tensor(const at::Tensor& x, int micro, int chunk)> chunk_forward;
  // Optional: the device's allocated memory in MiB (engine::memory_stats(device).allocated_mb),
  // read after each forward for PipelineStepResult::peak_activation_mb.
  std::function<double()> allocated_mb;
  // Optional, last stage: applied to loss / micro_batches before its backward (the fp16 loss
  // scale).
  std::function<at::Tensor(const at::Tensor& loss)> scale_loss;
  // Optional: called before the action that accumulates micro-batch i's weight gradients of
  // chunk c (its backward; zb: its W), and after it (the trainer keeps its gradient reducer in
  // no_sync until the last such action of each chunk, which every schedule runs for micro-batch
  // m - 1).
  std::function<void(int micro, int chunk)> before_backward, after_backward;
  // Optional: each forward ("forward"), backward ("backward"; zb: "backward input" and
  // "backward weight") and wait for a neighbour ("wait for stage s"), with its times (the timeline's lane of this stage), in the order they
  // ran. On the CPU: host clocks, each reported as it ends. On a CUDA device (activation_options'
  // device) the host only queues the work, so the times are the device's: CUDA events recorded
  // on the current stream around each call, read once at the end of the step (the step then
  // waits for the stage's device work) and placed on the host clock, all reported then. A wait
  // on the device is the time its stream stood still for the neighbour's message.
  // chunk: the model chunk a forward or backward computed (0 without chunks; the timeline gives
  // each virtual stage its lane), -1 for a wait.
  using Clock = std::chrono::steady_clock;
  std::function<void(const std::string& what, int micro, int chunk, Clock::time_point start, Clock::time_point end)>
      on_span;
  // Whether the last stage reads the mean loss to the host at the end (a device sync); false
  // leaves PipelineStepResult::loss at 0 and only loss_sum set.
  bool read_loss = true;
  // Out of memory in a stage (c10::OutOfMemoryError from forward or backward): false rethrows
  // at once, and the neighbours wait for messages that never come (until the collective
  // timeout). true (the trainer's OOM back-off) finishes the step's exchanges instead: the
  // stage skips its remaining computation, sends zeros where it owes an activation or a
  // gradient, and returns the error in PipelineStepResult::out_of_memory, so every stage ends
  // the step and the ranks can agree to retry it.
  bool finish_after_oom = false;
};

struct PipelineStepResult {
  double loss = 0;  // last stage: the mean of the micro-batches' losses; other stages: 0
  at::Tensor loss_sum;  // last stage: the sum of the micro-batches' losses (float64, on the device)
  int peak_in_flight = 0;  // the most micro-batches whose activations the stage held at once
  // Memory the stage's device held above what it held when the step began, at its highest
  // after a forward (the activations in flight; exact on the CPU, where tensors are counted).
  // 0 without PipelineStep::allocated_mb.
  double peak_activation_mb = 0;
  // In forward and backward computation (not waiting for a neighbour), by on_span's clocks:
  // the device's with on_span on a CUDA device, else the host's (on a GPU without on_span, the
  // time to queue the work).
  double busy_s = 0;
  double wall_s = 0;  // the whole step on this stage
  std::vector<PipelineAction> ran;  // the actions in the order they ran
  // With finish_after_oom: the out-of-memory error this stage met (its gradients and loss are
  // then not usable; the caller drops the step), else null.
  std::exception_ptr out_of_memory;
};

// Runs one step's forwards and backwards on this stage (collective over `pp`: every stage
// calls it with the same micro_batches, schedule and activation shape). Gradients accumulate
// into the parameters that forward uses.
PipelineStepResult run_pipeline_step(dist::Communicator& pp, const PipelineStep& step);

// Forwards only (evaluation, under the caller's no_grad): micro-batch after micro-batch through
// the stages; the last stage's loss_sum (and loss, with read_loss) as above. Ignores schedule,
// scale_loss and before_backward. Collective over `pp`.
PipelineStepResult run_pipeline_forward(dist::Communicator& pp, const PipelineStep& step);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
