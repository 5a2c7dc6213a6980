#include "dtrain/engine/parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/split_backward.h"

namespace dtrain::engine {

std::vector<int> pipeline_stage_bounds(int blocks, int stages, const std::string& counts) {
  DTRAIN_CHECK(stages >= 1, "pipeline: ", stages, " stages; --pp must be >= 1");
  DTRAIN_CHECK(blocks >= stages, "--pp=", stages, " stages but the model has only ", blocks, " block(s) (--layers); ",
               "every stage needs at least one block: lower --pp to at most ", blocks, " or add layers");
  std::vector<int> per_stage;
  if (counts.empty()) {
    per_stage.assign(stages, blocks / stages);
    // The remainder goes to stages 1, 2, ... (at most stages - 1 of them: the last is reached
    // only when every stage between has its extra block).
    for (int s = 1; s <= blocks % stages; ++s) ++per_stage[s];
  } else {
    std::string item;
    for (size_t i = 0; i <= counts.size(); ++i) {
      if (i < counts.size() && counts[i] != ',') {
        item += counts[i];
        continue;
      }
      size_t used = 0;
      int n = 0;
      try {
        n = std::stoi(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      DTRAIN_CHECK(!item.empty() && used == item.size() && n >= 1, "--pp_blocks=", counts, ": '", item,
                   "' is not a number of blocks >= 1; give one count per stage, e.g. --pp_blocks=2,4,4,2");
      per_stage.push_back(n);
      item.clear();
    }
    int sum = 0;
    for (int n : per_stage) sum += n;
    DTRAIN_CHECK(static_cast<int>(per_stage.size()) == stages && sum == blocks, "--pp_blocks=", counts, " gives ",
                 per_stage.size(), " stages ", sum, " blocks, but there are ", stages, " stages (--pp) and ", blocks,
                 " blocks (--layers); give one count per stage, summing to the blocks");
  }
  std::vector<int> bounds = {0};
  for (int n : per_stage) bounds.push_back(bounds.back() + n);
  return bounds;
}

namespace {

using Clock = PipelineStep::Clock;

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Times a stage's spans (PipelineStep::on_span) and its busy time. With host clocks on the CPU,
// and on any device without on_span: each span is reported as it ends. On a CUDA device with
// on_span, the host returns from a forward or backward as soon as its kernels are queued, so a
// span is a pair of timing events recorded on the current stream around the call; finish()
// waits for the stage's device work once, at the end of the step, and places every span on
// the host clock through a reference event recorded on the then idle stream, before reporting
// them in order.
class SpanTimer {
 public:
  struct Mark {
    Clock::time_point host;
    std::shared_ptr<c10::Event> event;  // device timing only
  };

  explicit SpanTimer(const PipelineStep& step)
      : on_span_(step.on_span), device_(step.activation_options.device()),
        on_device_(static_cast<bool>(step.on_span) && device_.is_cuda()) {}

  Mark mark() const {
    Mark m{Clock::now(), nullptr};
    if (on_device_) {
      m.event = std::make_shared<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
      m.event->record(current_stream());
    }
    return m;
  }
  // The span a..b; `busy` ones (forwards and backwards) add to busy_s.
  // chunk: the model chunk the span computes (-1: the stage's, e.g. a wait).
  void span(const std::string& what, int micro, const Mark& a, const Mark& b, bool busy, int chunk = -1) {
    if (!on_device_) {
      if (busy) busy_s_ += seconds(a.host, b.host);
      if (on_span_) on_span_(what, micro, chunk, a.host, b.host);
      return;
    }
    spans_.push_back({what, micro, chunk, a.event, b.event, busy});
  }
  // Device spans: waits for the last one's end, then reports them all (host spans went out
  // already). Returns the busy seconds.
  double finish() {
    if (spans_.empty()) return busy_s_;
    spans_.back().end->synchronize();
    c10::Event anchor(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    anchor.record(current_stream());  // the stream is idle: it fires at once
    anchor.synchronize();
    const Clock::time_point at = Clock::now();
    auto host = [&](const c10::Event& e) {
      const double ms = e.elapsedTime(anchor);  // from e to the anchor
      return at - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms));
    };
    for (const DeviceSpan& d : spans_) {
      const Clock::time_point a = host(*d.start), b = host(*d.end);
      if (d.busy) busy_s_ += seconds(a, b);
      on_span_(d.what, d.micro, d.chunk, a, b);
    }
    spans_.clear();
    return busy_s_;
  }

 private:
  struct DeviceSpan {
    std::string what;
    int micro;
    int chunk;
    std::shared_ptr<c10::Event> start, end;
    bool busy;
  };
  c10::Stream current_stream() const {
    c10::impl::VirtualGuardImpl impl(device_.type());
    return impl.getStream(device_);
  }
  const std::function<void(const std::string&, int, int, Clock::time_point, Clock::time_point)>& on_span_;
  const c10::Device device_;
  const bool on_device_;
  double busy_s_ = 0;              // host spans: as they end; device spans: at finish()
  std::vector<DeviceSpan> spans_;  // device spans not reported yet
};

// What both the training step and the forward-only pass check and share.
struct StageContext {
  dist::Communicator& pp;
  const PipelineStep& step;
  int stages, stage;
  bool first, last;
  SpanTimer timer;

  StageContext(dist::Communicator& comm, const PipelineStep& s)
      : pp(comm), step(s), stages(comm.size()), stage(comm.rank()), first(stage == 0), last(stage == stages - 1),
        timer(s) {
    DTRAIN_CHECK(step.micro_batches >= 1, "pipeline step: micro_batches must be >= 1, got ", step.micro_batches);
    DTRAIN_CHECK(step.chunks >= 1, "pipeline step: chunks must be >= 1, got ", step.chunks);
    DTRAIN_CHECK(step.chunks == 1 ? static_cast<bool>(step.forward) : static_cast<bool>(step.chunk_forward),
                 "pipeline step: ", step.chunks == 1 ? "forward" : "chunk_forward", " is empty; pass the stage's "
                 "computation");
    DTRAIN_CHECK(!first || static_cast<bool>(step.input), "pipeline step: the first stage needs input(micro)");
    DTRAIN_CHECK(stages == 1 || !step.activation_shape.empty(),
                 "pipeline step: activation_shape is empty; the receiving stage must know the activation's shape");
  }
  at::Tensor activation() const { return at::empty(step.activation_shape, step.activation_options); }
  // Chunk c is virtual stage c P + stage of chunks P: the first reads the input, the last computes
  // the loss; the one before chunk c of stage 0 is chunk c - 1 of the last stage (the ring wraps).
  int virtual_stage(int chunk) const { return chunk * stages + stage; }
  bool first_of(int chunk) const { return virtual_stage(chunk) == 0; }
  bool last_of(int chunk) const { return virtual_stage(chunk) == step.chunks * stages - 1; }
  int before(int chunk) const { return first_of(chunk) ? -1 : (stage + stages - 1) % stages; }
  int after(int chunk) const { return last_of(chunk) ? -1 : (stage + 1) % stages; }
  // What an action sends on (an activation, or the gradient of the stage's input), issued with
  // the next action's receive.
  struct Outbox {
    at::Tensor tensor;
    int peer = -1;
  };
  // Issues `out`'s send, if any, and a receive from stage `from` (none for from < 0) as one
  // group, then waits for the receive (timed) and returns what it received. NCCL runs a group's
  // operations together; issued one by one on its stream, a send of stage s to s+1 could wait
  // behind a receive from s+1 that waits for a send queued behind s+1's own receive from s (a
  // cycle Megatron-LM's send_forward_recv_backward pairs avoid the same way). Sends stay in
  // `sends` until they complete; the sent tensor is also held here until the group is closed
  // (every backend's Work holds it until the send completes too): inside a group NCCL launches
  // at the close, and memory freed before it could be handed to this group's receive.
  at::Tensor exchange(Outbox& out, int from, int micro, std::vector<dist::WorkPtr>& sends) {
    at::Tensor x;
    dist::WorkPtr received;
    const SpanTimer::Mark a = from >= 0 ? timer.mark() : SpanTimer::Mark{};
    {
      const Outbox sending = std::exchange(out, Outbox{});
      dist::CommGroup group(pp);
      if (sending.tensor.defined()) sends.push_back(pp.send(sending.tensor, sending.peer));
      if (from >= 0) {
        x = activation();
        received = pp.recv(x, from);
      }
      group.close();
    }
    if (received) {
      received->wait();
      timer.span("wait for stage " + std::to_string(from), micro, a, timer.mark(), /*busy=*/false);
    }
    return x;
  }
  // The same for a group of several sends (in order) and receives (from each of `froms`, in
  // order): returns what each receive got.
  std::vector<at::Tensor> exchange_group(std::vector<Outbox>& outs, const std::vector<int>& froms, int micro,
                                         std::vector<dist::WorkPtr>& sends) {
    std::vector<at::Tensor> got;
    if (outs.empty() && froms.empty()) return got;
    std::vector<dist::WorkPtr> received;
    const SpanTimer::Mark a = froms.empty() ? SpanTimer::Mark{} : timer.mark();
    {
      const std::vector<Outbox> sending = std::exchange(outs, {});
      dist::CommGroup group(pp);
      for (const Outbox& o : sending) sends.push_back(pp.send(o.tensor, o.peer));
      for (int from : froms) {
        got.push_back(activation());
        received.push_back(pp.recv(got.back(), from));
      }
      group.close();
    }
    for (auto& w : received) w->wait();
    if (!froms.empty()) timer.span("wait for stage " + std::to_string(froms.front()), micro, a, timer.mark(), false);
    return got;
  }
  // The stage's forward of micro-batch i (chunk `chunk`) on x (timed); checks what it returns.
  at::Tensor forward(const at::Tensor& x, int i, int chunk = 0) {
    const SpanTimer::Mark a = timer.mark();
    at::Tensor y = step.chunks == 1 ? step.forward(x, i) : step.chunk_forward(x, i, chunk);
    timer.span("forward", i, a, timer.mark(), /*busy=*/true, chunk);
    if (last_of(chunk)) {
      DTRAIN_CHECK(y.numel() == 1, "pipeline step: the last stage's forward must return the micro-batch's loss (a ",
                   "scalar), got ", y.sizes());
    } else {
      const at::ScalarType dtype = c10::typeMetaToScalarType(step.activation_options.dtype());
      DTRAIN_CHECK(y.sizes().vec() == step.activation_shape && y.scalar_type() == dtype, "pipeline step: stage ",
                   stage, " produced ", y.scalar_type(), y.sizes(), " but the pipeline sends ", dtype,
                   c10::IntArrayRef(step.activation_shape),
                   "; every micro-batch's activation must have activation_shape and dtype");
    }
    return y;
  }
  // Last stage: adds micro-batch loss y to the device-side sum (no host read per micro-batch).
  static void add_loss(at::Tensor& sum, const at::Tensor& y) {
    const at::Tensor loss = y.detach().to(at::kDouble).reshape({});
    sum = sum.defined() ? sum + loss : loss.clone();
  }
  void finish(PipelineStepResult& result, at::Tensor loss_sum, Clock::time_point start) {
    result.busy_s = timer.finish();
    if (last) {
      result.loss_sum = loss_sum;
      if (step.read_loss && loss_sum.defined()) result.loss = loss_sum.item<double>() / step.micro_batches;
    }
    result.wall_s = seconds(start, Clock::now());
  }
};

}  // namespace

namespace {

// One stage's training step: the schedule's actions on the micro-batches it holds in flight.
class TrainingStage {
 public:
  TrainingStage(dist::Communicator& pp, const PipelineStep& step)
      : ctx_(pp, step), step_(step), start_mb_(step.allocated_mb ? step.allocated_mb() : 0) {}

  PipelineStepResult run() {
    const Clock::time_point step_start = Clock::now();
    const std::vector<PipelineAction> actions =
        pipeline_actions(step_.schedule, ctx_.stages, ctx_.stage, step_.micro_batches, step_.chunks, step_.costs);
    const PipelineExchangePlan plan =
        pipeline_exchange_plan(step_.schedule, actions, ctx_.stages, ctx_.stage, step_.chunks);
    for (size_t k = 0; k < actions.size(); ++k) {
      const PipelineAction& action = actions[k];
      if (plan.issue[k]) {  // the sends so far and the receives the plan puts here (a W: sends only)
        std::vector<int> froms;
        for (int j : plan.receives[k]) {
          const PipelineAction& r = actions[static_cast<size_t>(j)];
          froms.push_back(r.kind == PipelineAction::kForward ? ctx_.before(r.chunk) : ctx_.after(r.chunk));
        }
        std::vector<at::Tensor> got = ctx_.exchange_group(outbox_, froms, action.micro, sends_);
        for (size_t r = 0; r < got.size(); ++r) inbox_[plan.receives[k][r]] = std::move(got[r]);
      }
      const int index = static_cast<int>(k);
      if (action.kind == PipelineAction::kBackwardWeight) {
        if (!result_.out_of_memory) backward_weight(action.micro);
      } else if (result_.out_of_memory) {
        keep_exchanges(index, action);
      } else if (action.kind == PipelineAction::kForward) {
        forward_micro(index, action.micro, action.chunk);
      } else {
        backward_micro(index, action.micro, action.chunk, action.kind == PipelineAction::kBackwardInput);
      }
      result_.ran.push_back(action);
      // A completed send's buffer (an activation or its gradient) is no longer needed: drop it
      // now rather than at the end of the step, or 1F1B's memory would grow with m.
      sends_.erase(std::remove_if(sends_.begin(), sends_.end(), [](const dist::WorkPtr& w) { return w->is_completed(); }),
                   sends_.end());
    }
    ctx_.exchange_group(outbox_, {}, step_.micro_batches, sends_);  // the last actions' sends
    for (auto& w : sends_) w->wait();
    ctx_.finish(result_, loss_sum_, step_start);
    return result_;
  }

 private:
  struct InFlight {
    at::Tensor input;   // what the stage received (requires grad), or the first stage's input
    at::Tensor output;  // the activation sent on, or the last stage's scaled loss
    std::shared_ptr<SplitBackward> split;  // zb: between the micro-batch's B and W
  };

  // After an out-of-memory error (finish_after_oom) the stage only keeps its side of the
  // exchanges: it receives what it is sent and sends zeros of the right shape to `to`.
  void failed(int to) {
    if (!step_.finish_after_oom) throw;
    if (!result_.out_of_memory) result_.out_of_memory = std::current_exception();
    held_.clear();  // the graphs of the micro-batches in flight go at once
    if (to >= 0) outbox_.push_back({ctx_.activation().zero_(), to});
  }

  // Action k after a failure: what it received is dropped; it sends zeros where it owes.
  void keep_exchanges(int k, const PipelineAction& a) {
    inbox_.erase(k);
    const int to = a.kind == PipelineAction::kForward ? ctx_.after(a.chunk) : ctx_.before(a.chunk);
    if (to >= 0) outbox_.push_back({ctx_.activation().zero_(), to});
  }

  // What action k received (its group came before it).
  at::Tensor take(int k) {
    auto it = inbox_.find(k);
    DTRAIN_CHECK(it != inbox_.end(), "pipeline step: action ", k, " has no message (a bug in dtrain)");
    at::Tensor t = std::move(it->second);
    inbox_.erase(it);
    return t;
  }

  // What a stage holds between a micro-batch's forward and its backward, per chunk.
  static int key(int micro, int chunk) { return chunk * (1 << 20) + micro; }

  void forward_micro(int k, int i, int chunk) {
    at::Tensor x = ctx_.first_of(chunk) ? step_.input(i) : take(k).requires_grad_(true);
    at::Tensor y;
    try {
      y = ctx_.forward(x, i, chunk);
    } catch (const c10::OutOfMemoryError&) {
      failed(ctx_.after(chunk));
      return;
    }
    if (ctx_.last_of(chunk)) {
      StageContext::add_loss(loss_sum_, y);
      y = y.reshape({}) / step_.micro_batches;
      if (step_.scale_loss) y = step_.scale_loss(y);
    } else {
      outbox_.push_back({y.detach().contiguous(), ctx_.after(chunk)});
    }
    held_[key(i, chunk)] = {x, y, nullptr};
    result_.peak_in_flight = std::max(result_.peak_in_flight, static_cast<int>(held_.size()));
    if (step_.allocated_mb) {
      result_.peak_activation_mb = std::max(result_.peak_activation_mb, step_.allocated_mb() - start_mb_);
    }
  }

  // The whole backward of micro-batch i, or (input_half) its B: the gradient of the stage's
  // input only, the weights' half kept for its W.
  void backward_micro(int k, int i, int chunk, bool input_half) {
    auto it = held_.find(key(i, chunk));
    DTRAIN_CHECK(it != held_.end(), "pipeline step: backward of micro-batch ", i, " before its forward");
    const at::Tensor grad = ctx_.last_of(chunk) ? at::Tensor() : take(k);
    if (!input_half && step_.before_backward) step_.before_backward(i, chunk);
    const SpanTimer::Mark a = ctx_.timer.mark();
    at::Tensor input_grad;
    try {
      InFlight& f = it->second;
      const at::Tensor out_grad = ctx_.last_of(chunk) ? at::Tensor() : grad;
      if (input_half) {
        f.split = std::make_shared<SplitBackward>(f.output, out_grad, ctx_.first_of(chunk) ? at::Tensor() : f.input);
        input_grad = f.split->input_grad();
      } else {
        f.output.backward(out_grad);
        if (!ctx_.first_of(chunk)) input_grad = f.input.grad();
        held_.erase(it);
      }
    } catch (const c10::OutOfMemoryError&) {
      failed(ctx_.before(chunk));
      return;
    }
    ctx_.timer.span(input_half ? "backward input" : "backward", i, a, ctx_.timer.mark(), /*busy=*/true, chunk);
    if (!input_half && step_.after_backward) step_.after_backward(i, chunk);
    if (!ctx_.first_of(chunk)) {
      DTRAIN_CHECK(input_grad.defined(), "pipeline step: stage ", ctx_.stage, "'s forward does not depend on its "
                   "input; the stage before would get no gradient");
      outbox_.push_back({input_grad.contiguous(), ctx_.before(chunk)});
    }
  }

  // zb: micro-batch i's W, the weight-gradient half of its backward; its activations go then.
  void backward_weight(int i) {
    auto it = held_.find(key(i, 0));  // zb: one chunk
    DTRAIN_CHECK(it != held_.end() && it->second.split, "pipeline step: backward weight of micro-batch ", i,
                 " before its backward input");
    if (step_.before_backward) step_.before_backward(i, 0);
    const SpanTimer::Mark a = ctx_.timer.mark();
    try {
      it->second.split->weight_half();
    } catch (const c10::OutOfMemoryError&) {
      failed(-1);
      return;
    }
    held_.erase(it);
    ctx_.timer.span("backward weight", i, a, ctx_.timer.mark(), /*busy=*/true, 0);
    if (step_.after_backward) step_.after_backward(i, 0);
  }

  StageContext ctx_;
  const PipelineStep& step_;
  const double start_mb_;
  std::map<int, InFlight> held_;
  std::vector<dist::WorkPtr> sends_;  // in flight (a Work keeps its buffer until it completes)
  PipelineStepResult result_;
  at::Tensor loss_sum_;  // on the device: read once, after the last micro-batch (no sync per micro-batch)
  std::vector<StageContext::Outbox> outbox_;  // the sends since the last group, issued with the next
  std::map<int, at::Tensor> inbox_;           // received ahead of its action, by action index
};

}  // namespace

PipelineStepResult run_pipeline_step(dist::Communicator& pp, const PipelineStep& step) {
  return TrainingStage(pp, step).run();
}

PipelineStepResult run_pipeline_forward(dist::Communicator& pp, const PipelineStep& step) {
  StageContext ctx(pp, step);
  const Clock::time_point start = Clock::now();
  PipelineStepResult result;
  at::Tensor loss_sum;
  std::vector<dist::WorkPtr> sends;
  StageContext::Outbox out;
  for (int i = 0; i < step.micro_batches; ++i) {
    for (int c = 0; c < step.chunks; ++c) {  // around the ring once per chunk
      at::Tensor x = ctx.exchange(out, ctx.before(c), i, sends);
      if (ctx.first_of(c)) x = step.input(i);
      at::Tensor y = ctx.forward(x, i, c);
      if (ctx.last_of(c)) {
        StageContext::add_loss(loss_sum, y);
      } else {
        out = {y.detach().contiguous(), ctx.after(c)};
      }
      result.ran.push_back({PipelineAction::kForward, i, c});
    }
  }
  ctx.exchange(out, -1, step.micro_batches, sends);
  for (auto& w : sends) w->wait();
  ctx.finish(result, loss_sum, start);
  return result;
}

}  // namespace dtrain::engine
