#include "dtrain/engine/parallel/reducer.h"

#include <algorithm>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <glog/logging.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/core/shard.h"
#include "reducer_buckets.h"

namespace dtrain::engine {
namespace {

using reducer_detail::assign_buckets;
using reducer_detail::assign_consecutive_buckets;
using reducer_detail::fixed_buckets;

using Clock = std::chrono::steady_clock;

struct Bucket {
  std::vector<size_t> params;   // indices into the parameter list
  std::vector<int64_t> offsets;  // element offsets in flat
  at::Tensor flat;               // the gradients' storage (the first numel elements of a padded one)
  at::Tensor wire;               // what is reduced (flat or its padded storage, or their compressed copy)
  int64_t flat_begin = 0;        // owner mode: the flat-space offset of element 0
  int64_t numel = 0;
  // With ReducerOptions::release_unowned, false for a bucket with no element this rank owns,
  // and false for every bucket of a strategy that keeps no gradients (ZeRO-3's): its storage is
  // allocated at its first gradient of a step and released once it is reduced.
  bool keep = true;
  // Whether a bucket observer reads one of its parameters (GradReducer::set_bucket_observer's
  // `observed`), and this bucket's place among those that are (LaunchedBucket::index).
  bool observed = true;
  size_t observed_index = 0;
  int pending = 0;
  bool ready = false;
  std::vector<dist::WorkPtr> works;  // one all-reduce, or one reduce per owner
  dist::WorkPtr mine;                // the work after which this rank's values are final
};

// Whether a (the wire) is b itself or b's padded storage, or neither is defined (a one-rank
// reducer's dropped buckets): nothing to copy between them.
bool shares_storage(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_same(b)) return true;
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.scalar_type() == b.scalar_type();
}

std::string param_label(const std::vector<std::string>& names, size_t i) {
  return i < names.size() ? "'" + names[i] + "' (#" + std::to_string(i) + ")"
                          : "#" + std::to_string(i);
}

// Runs after a parameter's gradient has been accumulated, whichever AccumulateGrad node did
// it. A hook on the tensor (not on its AccumulateGrad node) survives set_data() to another
// device or dtype, which gives the parameter a new node: layer offload moves parameters
// between host and GPU every step. Chains to a hook that was there before.
class ReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ReadyHook(std::function<void()> ready, std::unique_ptr<PostAccumulateGradHook> previous)
      : ready_(std::move(ready)), previous_(std::move(previous)) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    if (previous_) (*previous_)(tensor);
    ready_();
  }
  std::unique_ptr<PostAccumulateGradHook> take_previous() { return std::move(previous_); }

 private:
  std::function<void()> ready_;
  std::unique_ptr<PostAccumulateGradHook> previous_;
};

}  // namespace

struct GradReducer::State {
  State(dist::Communicator& c, ReducerOptions o) : comm(c), options(std::move(o)) {}

  dist::Communicator& comm;
  ReducerOptions options;
  std::shared_ptr<BucketComm> bucket_comm;  // options.bucket_comm, or the one they describe
  std::weak_ptr<State> shared_from_state;
  std::vector<at::Tensor> params;
  std::vector<ReadyHook*> hooks;  // by parameter; owned by the parameters' autograd meta

  mutable std::mutex mutex;
  // Everything below is guarded by mutex.
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, int64_t>> where;  // param -> (bucket, offset)
  std::vector<at::Tensor> views;                  // param -> its gradient view
  bool sync = true;
  bool in_step = false;        // a synchronized backward is under way
  bool finished = false;       // this step's synchronized backward completed (reset by zero_grad)
  bool callback_queued = false;
  bool many_runs = false;  // begin_runs(): the backward ends at end_runs(), not with a run
  size_t next_launch = 0;
  size_t next_complete = 0;  // buckets [0, next_complete) of this step are reduced and settled
  std::vector<char> param_ready;
  std::vector<size_t> arrival;  // first synchronized backward's arrival order
  int hooks_fired = 0;
  int64_t synced_backwards = 0;
  bool rebuilt = false;
  bool warned_unused = false;
  std::vector<size_t> unused;  // from prepare_for_backward
  ReducerStepStats stats;
  ReducerStepStats last_stats;
  std::function<void(const LaunchedBucket&)> observer;
  std::vector<char> observed;  // by parameter: whether the observer reads it (all, by default)
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;  // parameter -> its index (fixed)
  size_t observed_buckets = 0;  // buckets with an observed parameter

  void build(const std::vector<std::vector<size_t>>& assignment);
  void zero_buckets();
  void allocate(size_t b);
  void release(size_t b);
  // Waits for bucket b's reduction, records its timing, writes kept values back, and releases
  // it when this rank owns none of it.
  void complete(size_t b);
  // complete() for buckets [next_complete, end), every one settled even after a failure; the
  // first failure is returned.
  std::exception_ptr complete_until(size_t end);
  bool release_unowned = false;  // options.release_unowned on more than one rank
  bool release_reduced = false;  // the strategy keeps no gradients: every bucket goes once reduced
  at::Tensor kept;               // consecutive buckets: the kept buckets' storage, in flat order
  int64_t kept_begin = 0;        // its first element's flat-space offset
  FlatRange mine;                // this rank's owned range (release_unowned)
  std::vector<int64_t> flat_offsets;  // consecutive buckets: each parameter's flat-space offset
  // One rank, plain averaging: nothing to reduce.
  bool one_rank_plain() const {
    return comm.size() == 1 && !options.compress && options.owned.empty() && !release_reduced && !release_unowned &&
           dynamic_cast<const AllReduceBuckets*>(bucket_comm.get()) != nullptr;
  }
  // A bucket of one_rank_plain() that no bucket observer reads: its gradients stay autograd's
  // own (not added into zeroed bucket views: 1.7 ms of a GPT-124M step on the H100);
  // zero_buckets() drops them. With an observer (optimizer offload's gradient stream) only
  // the buckets holding a parameter it reads are views, so layer offload's host-resident
  // blocks keep autograd's gradients beside it (--offload=all).
  bool local(const Bucket& b) const { return one_rank_plain() && !(observer && b.observed); }
  bool local_param(size_t i) const { return local(buckets[where[i].first]); }
  // Every bucket local(b).
  bool local() const { return one_rank_plain() && (!observer || observed_buckets == 0); }
  // Each bucket's `observed` and `observed_index` from `observed`.
  void mark_observed();
  void start_step();
  void mark_ready(size_t i);
  void launch_in_order();
  void launch(size_t b);
  void finish_step(bool abandoned);
  void on_hook(size_t i);
  void rebuild();
};

void GradReducer::State::build(const std::vector<std::vector<size_t>>& assignment) {
  buckets.assign(assignment.size(), Bucket());
  where.assign(params.size(), {0, 0});
  views.assign(params.size(), at::Tensor());
  kept = at::Tensor();
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.params = assignment[b];
    for (size_t i : bucket.params) {
      bucket.offsets.push_back(bucket.numel);
      where[i] = {b, bucket.numel};
      bucket.numel += params[i].numel();
    }
    if (!flat_offsets.empty()) bucket.flat_begin = flat_offsets[bucket.params.front()];
    if (release_unowned) {
      const int64_t lo = std::max(bucket.flat_begin, mine.begin);
      const int64_t hi = std::min(bucket.flat_begin + bucket.numel, mine.end);
      bucket.keep = lo < hi;
    }
    if (release_reduced) bucket.keep = false;
  }
  mark_observed();
  // Consecutive buckets: the kept ones (all, unless release_unowned) are one run of the flat
  // space; one allocation holds them end to end in flat order, so a range of it is one view
  // (flat_gradients()).
  if (!flat_offsets.empty()) {
    int64_t begin = -1, end = -1;
    bool one_kind = true;
    const at::Tensor* first = nullptr;
    for (const Bucket& bucket : buckets) {
      if (!bucket.keep) continue;
      const at::Tensor& p = params[bucket.params.front()];
      if (first && (p.scalar_type() != first->scalar_type() || p.device() != first->device())) one_kind = false;
      if (!first) first = &p;
      begin = begin < 0 ? bucket.flat_begin : std::min(begin, bucket.flat_begin);
      end = std::max(end, bucket.flat_begin + bucket.numel);
    }
    if (first && one_kind) {
      kept = at::zeros({end - begin}, first->options());
      kept_begin = begin;
    }
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    // A released bucket is allocated by its first gradient, unless a gradient exists already.
    bool has_grad = false;
    for (size_t i : buckets[b].params) has_grad = has_grad || params[i].grad().defined();
    // Local buckets too: until the first zero_grad() their views are the gradients (what the
    // planner counts as a step's gradients from its start).
    if (buckets[b].keep || has_grad) allocate(b);
  }
}

void GradReducer::State::mark_observed() {
  observed_buckets = 0;
  for (Bucket& b : buckets) {
    b.observed = false;
    for (size_t i : b.params) b.observed = b.observed || observed.empty() || observed[i];
    b.observed_index = observed_buckets;
    if (b.observed) ++observed_buckets;
  }
}

void GradReducer::State::zero_buckets() {
  if (local()) kept.reset();
  if (kept.defined()) kept.zero_();  // every kept bucket, one launch
  for (Bucket& b : buckets) {
    if (local(b)) {
      for (size_t i : b.params) {
        params[i].mutable_grad().reset();
        views[i].reset();
      }
      b.flat = b.wire = at::Tensor();
    } else if (b.flat.defined() && !(b.keep && kept.defined())) {
      b.flat.zero_();
    }
  }
}

void GradReducer::State::allocate(size_t b) {
  Bucket& bucket = buckets[b];
  if (bucket.flat.defined()) return;
  const at::Tensor& first = params[bucket.params.front()];
  if (bucket.keep && kept.defined()) {
    bucket.flat = kept.narrow(0, bucket.flat_begin - kept_begin, bucket.numel);
    bucket.wire = bucket_comm->wire(bucket.flat);
  } else {
    // The strategy may want the bucket padded: the gradients are the storage's first elements.
    const at::Tensor storage = at::zeros({bucket_comm->storage_numel(bucket.numel)}, first.options());
    bucket.flat = storage.narrow(0, 0, bucket.numel);
    bucket.wire = bucket_comm->wire(storage);
  }
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const size_t i = bucket.params[k];
    at::Tensor& grad = params[i].mutable_grad();
    at::Tensor view = bucket.flat.narrow(0, bucket.offsets[k], params[i].numel()).view(params[i].sizes());
    if (grad.defined()) view.copy_(grad);
    grad = view;
    views[i] = view;
  }
}

void GradReducer::State::release(size_t b) {
  Bucket& bucket = buckets[b];
  if (bucket.keep || !bucket.flat.defined()) return;
  // A bucket observer's LaunchedBucket::values keeps the storage alive as long as it needs it.
  for (size_t i : bucket.params) {
    views[i] = at::Tensor();
    params[i].mutable_grad() = at::Tensor();
  }
  bucket.flat = at::Tensor();
  bucket.wire = at::Tensor();
}

void GradReducer::State::start_step() {
  in_step = true;
  next_launch = 0;
  next_complete = 0;
  hooks_fired = 0;
  param_ready.assign(params.size(), 0);
  for (Bucket& b : buckets) {
    b.pending = static_cast<int>(b.params.size());
    b.ready = false;
    b.works.clear();
    b.mine.reset();
  }
  stats = ReducerStepStats();
  stats.bucket_launch.reserve(buckets.size());
}

void GradReducer::State::mark_ready(size_t i) {
  if (param_ready[i]) return;
  param_ready[i] = 1;
  Bucket& b = buckets[where[i].first];
  if (--b.pending == 0) b.ready = true;
}

void GradReducer::State::launch_in_order() {
  while (next_launch < buckets.size() && buckets[next_launch].ready) launch(next_launch++);
}

void GradReducer::State::launch(size_t b) {
  if (local(buckets[b])) {  // nothing to reduce: the gradients are final
    stats.bucket_launch.push_back(Clock::now());
    stats.hooks_before_launch.push_back(hooks_fired), stats.bucket_bytes.push_back(0);
    return;
  }
  allocate(b);  // a released bucket none of whose parameters got a gradient: zeros
  Bucket& bucket = buckets[b];
  if (!shares_storage(bucket.wire, bucket.flat)) bucket.wire.narrow(0, 0, bucket.numel).copy_(bucket.flat);
  stats.bucket_launch.push_back(Clock::now());
  stats.hooks_before_launch.push_back(hooks_fired);
  stats.bucket_bytes.push_back(bucket.wire.numel() * bucket.wire.element_size());
  stats.bytes += stats.bucket_bytes.back();
  BucketLaunch launched = bucket_comm->launch(bucket.wire, bucket.flat_begin, comm);
  bucket.works = std::move(launched.works);
  bucket.mine = std::move(launched.mine);
  if (observer && bucket.observed) {
    LaunchedBucket event;
    event.backward = synced_backwards;
    event.index = bucket.observed_index;
    event.count = observed_buckets;
    event.params = bucket.params;
    event.offsets = bucket.offsets;
    event.values = bucket.wire;
    event.work = bucket.mine;
    observer(event);
  }
  // ZeRO-2/3: a bucket none of which is ours is released once its reduction completes, so at
  // most this bucket and the gradients still to come are whole during backward: wait for the
  // ones launched before it (the reduction of this one overlaps the rest of backward).
  if (release_unowned || release_reduced) {
    while (next_complete < b) complete(next_complete++);
  }
}

void GradReducer::State::complete(size_t k) {
  Bucket& b = buckets[k];
  struct Settle {  // the bucket is settled whether or not its reduction failed
    State* s;
    size_t k;
    ~Settle() {
      Bucket& b = s->buckets[k];
      b.works.clear();
      b.mine.reset();
      s->release(k);  // ZeRO-2: none of this bucket is ours, and its reduction is complete
    }
  } settle{this, k};
  if (!b.works.empty()) {
    for (const dist::WorkPtr& w : b.works) w->wait();
    Clock::time_point start, end, s2, e2;
    if (!b.works.front()->timing(&start, &s2) || !b.works.back()->timing(&e2, &end)) {
      start = k < stats.bucket_launch.size() ? stats.bucket_launch[k] : Clock::now();
      end = Clock::now();
    }
    stats.bucket_start.push_back(start);
    stats.bucket_end.push_back(end);
  }
  if (b.keep && !shares_storage(b.wire, b.flat)) b.flat.copy_(b.wire.narrow(0, 0, b.numel));
}

std::exception_ptr GradReducer::State::complete_until(size_t end) {
  std::exception_ptr failure;
  for (; next_complete < end; ++next_complete) {
    try {
      complete(next_complete);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  return failure;
}

void GradReducer::State::on_hook(size_t i) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!local_param(i)) {
    // The gradient must live in its bucket; if someone replaced .grad, copy it back.
    allocate(where[i].first);  // the first gradient of a released bucket
    at::Tensor& grad = params[i].mutable_grad();
    if (!grad.defined() || grad.data_ptr() != views[i].data_ptr()) {
      if (grad.defined()) views[i].copy_(grad);
      grad = views[i];
    }
  }
  if (!sync) return;
  if (!in_step) start_step();
  if (!callback_queued && !many_runs) {
    callback_queued = true;
    std::weak_ptr<State> weak = shared_from_state;
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto self = weak.lock()) self->finish_step(/*abandoned=*/false);
    });
  }
  if (hooks_fired == 0) stats.first_hook = Clock::now();
  ++hooks_fired;
  if (synced_backwards == 0) arrival.push_back(i);
  mark_ready(i);
  launch_in_order();
}

void GradReducer::State::finish_step(bool abandoned) {
  std::lock_guard<std::mutex> lock(mutex);
  stats.backward_end = Clock::now();
  if (!in_step) start_step();
  // Parameters without a gradient this step: zero contributions, launched in order.
  std::vector<size_t> missing;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!param_ready[i]) missing.push_back(i);
  }
  for (size_t i : missing) {
    mark_ready(i);  // and, local(), zeros as the gradient (what its zeroed bucket view held)
    if (local_param(i) && !params[i].grad().defined()) params[i].mutable_grad() = at::zeros_like(params[i]);
  }
  launch_in_order();
  stats.unused_parameters += static_cast<int>(missing.size());
  if (!missing.empty() && !abandoned && !options.find_unused_parameters && !warned_unused) {
    warned_unused = true;
    std::ostringstream os;
    for (size_t k = 0; k < std::min<size_t>(missing.size(), 8); ++k)
      os << (k ? ", " : "") << param_label(options.names, missing[k]);
    LOG(WARNING) << missing.size() << " parameter(s) got no gradient in this backward (" << os.str()
                 << (missing.size() > 8 ? ", ..." : "")
                 << "); they are reduced as zeros at the end of backward. Construct the reducer "
                    "with find_unused_parameters and call prepare_for_backward(outputs) to "
                    "start their buckets early.";
  }
  std::exception_ptr failure = complete_until(buckets.size());
  stats.reduced = Clock::now();
  last_stats = stats;
  in_step = false;
  finished = true;
  callback_queued = false;
  unused.clear();
  // An abandoned step counts too: it matched the other ranks' synchronized backward, so every
  // rank's count stays equal and the rebuild below happens at the same zero_grad everywhere.
  ++synced_backwards;
  if (failure) std::rethrow_exception(failure);
}

void GradReducer::State::rebuild() {
  rebuilt = true;
  // Arrival order of this rank, then parameters that never arrived (reverse registration).
  std::vector<size_t> order = arrival;
  std::vector<char> seen(params.size(), 0);
  for (size_t i : order) seen[i] = 1;
  for (size_t i = params.size(); i-- > 0;) {
    if (!seen[i]) order.push_back(i);
  }
  // Everyone uses rank 0's order so bucket k holds the same parameters on every rank.
  at::Tensor t = at::empty({static_cast<int64_t>(order.size())}, at::kLong);
  for (size_t k = 0; k < order.size(); ++k) t[k] = static_cast<int64_t>(order[k]);
  comm.broadcast(t, 0)->wait();
  for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<size_t>(t[k].item<int64_t>());
  build(assign_buckets(params, order, options.first_bucket_bytes, options.bucket_bytes));
}

namespace {

void check_reducer_inputs(const std::vector<at::Tensor>& params, const ReducerOptions& options) {
  DTRAIN_CHECK(!params.empty(), "GradReducer needs at least one parameter");
  DTRAIN_CHECK(options.names.empty() || options.names.size() == params.size(),
               "ReducerOptions.names has ", options.names.size(), " names for ", params.size(),
               " parameters");
  DTRAIN_CHECK(options.bucket_bytes > 0 && options.first_bucket_bytes > 0,
               "bucket sizes must be positive (got first ", options.first_bucket_bytes, ", then ",
               options.bucket_bytes, " bytes)");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    DTRAIN_CHECK(p.defined() && p.requires_grad() && p.is_leaf(), "parameter ",
                 param_label(options.names, i), " must be a leaf tensor that requires grad");
    DTRAIN_CHECK(p.is_contiguous(), "parameter ", param_label(options.names, i),
                 " is not contiguous; make it contiguous before creating the reducer");
    DTRAIN_CHECK(at::isFloatingType(p.scalar_type()), "parameter ", param_label(options.names, i),
                 " has dtype ", p.scalar_type(), "; gradients must be floating point");
  }
  DTRAIN_CHECK(!options.bucket_comm || !options.compress, "ReducerOptions.compress applies to the reducer's own "
               "strategies; a given ReducerOptions.bucket_comm (", options.bucket_comm->name(), ") is used as it is: "
               "wrap it in CompressedBuckets, or drop compress");
  DTRAIN_CHECK(!options.release_unowned || !options.owned.empty(),
               "ReducerOptions.release_unowned needs ReducerOptions.owned (which rank owns which gradients)");
}

// The options' bucket strategy when none is given: all-reduce, or reduce to each gradient's
// owner, either compressed.
std::shared_ptr<BucketComm> default_bucket_comm(const ReducerOptions& options, int ranks, int64_t total) {
  std::unique_ptr<BucketComm> made;
  if (options.owned.empty()) {
    made = std::make_unique<AllReduceBuckets>();
  } else {
    made = std::make_unique<ReduceToOwnerBuckets>(options.owned, ranks, total);
  }
  if (options.compress) made = std::make_unique<CompressedBuckets>(std::move(made), *options.compress);
  return made;
}

// For each parameter, the first and last rank whose owned range it overlaps.
std::vector<std::pair<int, int>> owner_spans_of(const std::vector<at::Tensor>& params,
                                                const std::vector<int64_t>& flat_offsets,
                                                const std::vector<std::pair<int64_t, int64_t>>& owned) {
  std::vector<std::pair<int, int>> spans;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t a = flat_offsets[i], e = a + params[i].numel();
    std::pair<int, int> span{-1, -1};
    for (int r = 0; r < static_cast<int>(owned.size()); ++r) {
      if (std::max(a, owned[r].first) < std::min(e, owned[r].second)) {
        if (span.first < 0) span.first = r;
        span.second = r;
      }
    }
    spans.push_back(span);
  }
  return spans;
}

}  // namespace

GradReducer::GradReducer(std::vector<at::Tensor> params, dist::Communicator& comm,
                         ReducerOptions options)
    : params_(std::move(params)) {
  check_reducer_inputs(params_, options);
  // The bucket strategy first: its bad options throw before any collective.
  std::shared_ptr<BucketComm> bucket_comm = options.bucket_comm;
  std::vector<int64_t> flat_offsets;
  int64_t total = 0;
  for (const at::Tensor& p : params_) {
    flat_offsets.push_back(total);
    total += p.numel();
  }
  if (!bucket_comm) bucket_comm = default_bucket_comm(options, comm.size(), total);
  DTRAIN_CHECK(!options.release_unowned || bucket_comm->consecutive_buckets(), "ReducerOptions.release_unowned needs a ",
               "bucket strategy over consecutive buckets (", bucket_comm->name(), " is not)");
  check_same_parameters(params_, comm, options.names);
  if (options.broadcast_parameters) {
    at::NoGradGuard no_grad;
    broadcast_tensors(comm, params_, 0);
  }
  state_ = std::make_shared<State>(comm, std::move(options));
  state_->shared_from_state = state_;
  state_->params = params_;
  for (size_t i = 0; i < params_.size(); ++i) state_->index_of.emplace(params_[i].unsafeGetTensorImpl(), i);
  state_->bucket_comm = std::move(bucket_comm);
  if (state_->bucket_comm->consecutive_buckets()) {
    std::vector<std::pair<int, int>> owner_spans;
    if (state_->options.release_unowned && comm.size() > 1) {
      // Buckets close where the owner changes: all but a straddling parameter's bucket are
      // wholly one rank's, so a rank keeps about 1/N of the gradient storage.
      const auto& owned = state_->options.owned;
      state_->release_unowned = true;
      state_->mine = FlatRange{owned[comm.rank()].first, owned[comm.rank()].second};
      owner_spans = owner_spans_of(params_, flat_offsets, owned);
    }
    state_->flat_offsets = std::move(flat_offsets);
    state_->rebuilt = true;  // the buckets stay consecutive ranges of the flat space
    state_->release_reduced = !state_->bucket_comm->keeps_gradients();
    const std::vector<size_t> starts = state_->bucket_comm->bucket_starts();
    state_->build(starts.empty() ? assign_consecutive_buckets(params_, state_->options.first_bucket_bytes,
                                                              state_->options.bucket_bytes, owner_spans)
                                 : fixed_buckets(params_, starts, state_->bucket_comm->name()));
  } else {
    std::vector<size_t> order(params_.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = params_.size() - 1 - k;  // reverse
    state_->build(assign_buckets(params_, order, state_->options.first_bucket_bytes,
                                 state_->options.bucket_bytes));
  }
  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(params_[i]);
    auto hook = std::make_unique<ReadyHook>(
        [weak, i] {
          if (auto self = weak.lock()) self->on_hook(i);
        },
        std::move(slot));
    state_->hooks.push_back(hook.get());
    torch::autograd::impl::set_post_acc_grad_hooks(params_[i], std::move(hook));
  }
}

GradReducer::~GradReducer() {
  try {
    for (size_t i = 0; i < state_->hooks.size(); ++i) {
      auto& slot = torch::autograd::impl::post_acc_grad_hooks(params_[i]);
      if (slot.get() == state_->hooks[i]) slot = state_->hooks[i]->take_previous();
    }
    // Gradients become ordinary tensors again (they keep the bucket storage alive).
  } catch (const std::exception& e) {
    LOG(ERROR) << "GradReducer teardown: " << e.what();
  }
}

void check_same_parameters(const std::vector<at::Tensor>& params, dist::Communicator& comm,
                           const std::vector<std::string>& names) {
  // Count first, then every parameter's dtype and shape against rank 0's.
  const int64_t count = static_cast<int64_t>(params.size());
  at::Tensor counts = at::tensor({count, -count}, at::kLong);
  comm.all_reduce(counts, dist::ReduceOp::kMax)->wait();
  DTRAIN_CHECK(counts[0].item<int64_t>() == count && -counts[1].item<int64_t>() == count,
               "ranks disagree on the number of parameters: this rank has ", count,
               ", others have between ", -counts[1].item<int64_t>(), " and ", counts[0].item<int64_t>(),
               "; build the same model on every rank");
  constexpr int kCols = 9;
  at::Tensor mine = at::full({count, kCols}, -1, at::kLong);
  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor& p = params[i];
    mine[i][0] = static_cast<int64_t>(p.scalar_type());
    mine[i][1] = p.dim();
    for (int64_t d = 0; d < std::min<int64_t>(p.dim(), kCols - 2); ++d) mine[i][2 + d] = p.size(d);
  }
  at::Tensor rank0 = mine.clone();
  comm.broadcast(rank0, 0)->wait();
  at::Tensor differs = (mine != rank0).any(1);
  int64_t first = differs.any().item<bool>() ? differs.nonzero()[0][0].item<int64_t>() : count;
  at::Tensor agreed = at::tensor({first}, at::kLong);
  comm.all_reduce(agreed, dist::ReduceOp::kMin)->wait();
  int64_t bad = agreed.item<int64_t>();
  if (bad < count) {
    // The lowest rank whose parameter differs from rank 0's, and its dtype and shape.
    at::Tensor other = at::tensor({differs[bad].item<bool>() ? static_cast<int64_t>(comm.rank()) : comm.size()}, at::kLong);
    comm.all_reduce(other, dist::ReduceOp::kMin)->wait();
    const int r = static_cast<int>(other.item<int64_t>());
    at::Tensor row = mine[bad].clone();
    comm.broadcast(row, r)->wait();
    auto describe = [&](const at::Tensor& t) {
      std::ostringstream os;
      os << static_cast<at::ScalarType>(t[0].item<int64_t>()) << "[";
      for (int64_t d = 0; d < t[1].item<int64_t>() && d < kCols - 2; ++d) os << (d ? ", " : "") << t[2 + d].item<int64_t>();
      os << "]";
      return os.str();
    };
    throw Error(detail::concat("parameter ", param_label(names, static_cast<size_t>(bad)),
                               " differs across ranks: rank 0 has ", describe(rank0[bad]), ", rank ", r, " has ",
                               describe(row), "; every rank must build the same model"));
  }
}

GradReducer::NoSync::NoSync(GradReducer* reducer) : reducer_(reducer) { reducer_->set_sync(false); }
GradReducer::NoSync::~NoSync() {
  if (reducer_) reducer_->set_sync(true);
}
GradReducer::NoSync::NoSync(NoSync&& other) noexcept : reducer_(other.reducer_) { other.reducer_ = nullptr; }

void GradReducer::begin_runs() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  DTRAIN_CHECK(!state_->many_runs && !state_->callback_queued, "GradReducer::begin_runs() inside another "
               "begin_runs(), or during a backward");
  state_->many_runs = true;
}

void GradReducer::end_runs() {
  bool end = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->many_runs = false;
    end = state_->in_step;  // a synchronized backward began in one of the runs
  }
  if (end) state_->finish_step(/*abandoned=*/false);
}

void GradReducer::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  // Between the runs of a begin_runs() backward the runs may differ: an interleaved pipeline
  // stage's runs for one chunk's last micro-batch synchronize, those for the others' earlier
  // micro-batches only accumulate.
  if (state_->in_step && !state_->many_runs) {
    LOG(ERROR) << "no_sync started or ended during a synchronized backward pass; ignored";
    return;
  }
  state_->sync = enabled;
}

void GradReducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  if (!state_->options.find_unused_parameters) return;
  // Every node reachable from the outputs' graph, and the parameters it accumulates into, by
  // tensor: not by the parameter's current AccumulateGrad node, which set_data() to another
  // device or dtype forgets (layer offload moves each streamed block's weights to the GPU and
  // back inside its forward, so the node in the graph is no longer the one the parameter names).
  std::unordered_set<torch::autograd::Node*> seen;
  std::unordered_set<const c10::TensorImpl*> reached;
  std::vector<torch::autograd::Node*> stack;
  for (const at::Tensor& out : outputs) {
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n)) reached.insert(acc->variable.unsafeGetTensorImpl());
    for (const auto& edge : n->next_edges()) {
      if (edge.function && !seen.count(edge.function.get())) stack.push_back(edge.function.get());
    }
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->sync) return;
  if (!state_->in_step) state_->start_step();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!reached.count(params_[i].unsafeGetTensorImpl()) && !state_->param_ready[i]) {
      state_->mark_ready(i);
      ++state_->stats.unused_parameters;
    }
  }
  state_->launch_in_order();
}

bool GradReducer::keeps_autograd_gradients() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->local();
}

bool GradReducer::holds(const at::Tensor& param) const {
  return state_->index_of.count(param.unsafeGetTensorImpl()) > 0;  // fixed at construction: no lock
}

bool GradReducer::keeps_autograd_gradients(const std::vector<at::Tensor>& params) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (const at::Tensor& p : params) {
    auto it = state_->index_of.find(p.unsafeGetTensorImpl());
    DTRAIN_CHECK(it != state_->index_of.end(), "GradReducer::keeps_autograd_gradients: a tensor of shape ", p.sizes(),
                 " is not one of the reducer's parameters");
    if (!state_->local_param(it->second)) return false;
  }
  return true;
}

void GradReducer::zero_grad() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  State& s = *state_;
  if (s.options.rebuild_buckets && !s.rebuilt && s.synced_backwards >= 1) {
    s.rebuild();  // collective: every rank reaches its first zero_grad after the first step
  }
  s.zero_buckets();
  s.finished = false;
}

void GradReducer::abandon_step() {
  bool owes = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->sync = true;
    state_->many_runs = false;  // a failure between begin_runs() and end_runs()
    owes = !state_->finished;
  }
  if (owes) state_->finish_step(/*abandoned=*/true);
  // Zero without the (collective) bucket rebuild: the other ranks are elsewhere now.
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->zero_buckets();
}

void GradReducer::forget_step() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  State& s = *state_;
  s.sync = true;
  s.many_runs = false;
  if (!s.in_step) return;
  std::exception_ptr failure = s.complete_until(s.next_launch);
  s.in_step = false;
  s.callback_queued = false;  // autograd drops a failed backward's final callbacks
  s.unused.clear();
  if (s.synced_backwards == 0) s.arrival.clear();  // the run again records the order afresh
  if (failure) std::rethrow_exception(failure);
}

void GradReducer::set_bucket_observer(std::function<void(const LaunchedBucket&)> observer,
                                      std::vector<char> observed) {
  DTRAIN_CHECK(observed.empty() || observed.size() == params_.size(), "GradReducer::set_bucket_observer: `observed` ",
               "has ", observed.size(), " entries for ", params_.size(), " parameters (empty: every parameter)");
  std::lock_guard<std::mutex> lock(state_->mutex);
  State& s = *state_;
  // Removing one is safe at any time (a teardown): the buckets left to launch are one rank's
  // final gradients already, or are reduced as before.
  DTRAIN_CHECK(!observer || !s.in_step,
               "GradReducer::set_bucket_observer during a synchronized backward; set it between steps");
  s.observer = std::move(observer);
  s.observed = s.observer ? std::move(observed) : std::vector<char>();
  s.mark_observed();
  // A bucket that stops being local holds its gradients again (autograd's own are copied in).
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    if (!s.local(s.buckets[b]) && s.buckets[b].keep) s.allocate(b);
  }
}

const BucketComm& GradReducer::bucket_comm() const { return *state_->bucket_comm; }

int GradReducer::num_buckets() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int>(state_->buckets.size());
}

std::vector<std::vector<size_t>> GradReducer::bucket_params() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<std::vector<size_t>> out;
  for (const Bucket& b : state_->buckets) out.push_back(b.params);
  return out;
}

ReducerStepStats GradReducer::last_step_stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->last_stats;
}

int64_t GradReducer::gradient_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const State& s = *state_;
  int64_t bytes = s.kept.defined() ? s.kept.nbytes() : 0;
  for (const Bucket& b : s.buckets) {
    if (b.flat.defined() && !(b.keep && s.kept.defined())) bytes += b.flat.storage().nbytes();  // padding included
    if (b.wire.defined() && !shares_storage(b.wire, b.flat)) bytes += b.wire.nbytes();
  }
  return bytes;
}

at::Tensor GradReducer::flat_gradients(int64_t begin, int64_t end) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const State& s = *state_;
  if (!s.kept.defined() || begin < s.kept_begin || end > s.kept_begin + s.kept.numel() || begin > end) return {};
  return s.kept.narrow(0, begin - s.kept_begin, end - begin);
}

int64_t GradReducer::synchronized_backwards() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->synced_backwards;
}

}  // namespace dtrain::engine
