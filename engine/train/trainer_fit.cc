// The Trainer's loop over a loader (trainer.h): fit() with its logging, periodic evaluation,
// checkpoints and preemption, evaluation on a held-out loader, and the step's timeline.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <glog/logging.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/parallel/context_parallel.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/engine/train/agreement.h"
#include "dtrain/engine/train/preemption.h"
#include "dtrain/engine/train/trainer.h"

namespace dtrain::engine {

double Trainer::read_loss() {
  settle_nonfinite();  // the deferred watch's policy, before anyone sees the loss
  if (!pending_loss_) return std::numeric_limits<double>::quiet_NaN();
  pending_loss_->wait();
  pending_loss_.reset();
  return pending_loss_tensor_.item<double>();
}

void shard_loader(const dist::Mesh& mesh, DataLoader& loader, const std::string& which) {
  const LoaderOptions lo = loader.options();
  const int rank = mesh.dp_rank(), size = mesh.dp_size();
  const bool matches = lo.dp_rank == rank && lo.dp_size == size;
  const bool unsharded = lo.dp_rank == 0 && lo.dp_size == 1;
  std::string problem;
  if (!matches && !unsharded) {
    std::ostringstream os;
    os << which << " is sharded for data-parallel rank " << lo.dp_rank << " of " << lo.dp_size
       << ", but this rank is data-parallel rank " << rank << " of " << size
       << " (the trainer's mesh); leave LoaderOptions::dp_rank/dp_size at 0/1 and the trainer shards it, "
          "or set them to mesh.dp_rank()/mesh.dp_size()";
    problem = os.str();
  }
  // Collective, so that a layout wrong on some ranks only (dp_rank 0 everywhere) stops every
  // rank, not just those, while the others wait in their next collective.
  const std::vector<std::string> problems = gather_texts(mesh.world(), problem);
  if (!problem.empty()) throw Error(problem);
  for (size_t r = 0; r < problems.size(); ++r) {
    if (!problems[r].empty()) {
      throw Error(which + " is sharded for another data-parallel layout on another rank (rank " +
                  std::to_string(r) + ": " + problems[r] + ")");
    }
  }
  if (matches) return;
  loader.shard(rank, size);
  if (mesh.world().rank() == 0) {
    LOG(INFO) << which << ": sharded over the " << size << " data-parallel ranks (each rank its own "
              << lo.batch_size << " samples of a " << lo.batch_size * size << "-sample global batch)";
  }
}

void Trainer::score_batch(const Batch& batch, double weight, at::Tensor& sums) {
  AutocastGuard autocast(device_.type(), options_.amp);
  if (options_.eval_loss_and_correct) {
    auto [loss, correct] = options_.eval_loss_and_correct(batch);
    sums[0].add_(loss.detach().to(at::kDouble).reshape({}) * weight);
    sums[1].add_(correct.detach().to(at::kDouble).reshape({}) * (weight > 0 ? 1.0 : 0.0));
  } else if (mesh_.pp_size() > 1) {
    sums[0].add_(pipeline_eval_loss(batch) * weight);  // zero except on the last stage
  } else {
    sums[0].add_(loss_(batch).detach().to(at::kDouble).reshape({}) * weight);
  }
}

namespace {
// Context parallelism: each rank of a group scored its part of the same samples. Its loss is
// the mean over its tokens (as many on every rank): the group's average is the samples' mean;
// correct predictions add up; the rows are the group's (counted once).
void combine_context_parallel(const dist::Mesh& mesh, at::Tensor& sums, bool counting) {
  if (mesh.cp_size() <= 1) return;
  at::Tensor loss = sums.narrow(0, 0, 1);
  mesh.cp().all_reduce(loss, dist::ReduceOp::kAvg)->wait();
  if (counting) {
    at::Tensor correct = sums.narrow(0, 1, 1);
    mesh.cp().all_reduce(correct, dist::ReduceOp::kSum)->wait();
  }
}
}  // namespace

double Trainer::evaluate(DataLoader& eval, int64_t batches) {
  shard_loader(mesh_, eval, "the evaluation loader");
  const bool was_training = model_.is_training();
  model_.eval();
  // [loss sum, correct predictions, rows], summed on the device: one host read at the end.
  at::Tensor sums = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device_));
  const bool counting = static_cast<bool>(options_.eval_loss_and_correct);
  {
    torch::NoGradGuard no_grad;
    for (int64_t b = 0; b < batches; ++b) {
      Batch batch = eval.next();
      score_batch(batch, /*weight=*/1.0, sums);
      if (counting) sums[2].add_(static_cast<double>(batch.size()));
    }
  }
  model_.train(was_training);
  sums[0].div_(static_cast<double>(batches));
  // Every rank evaluates as many batches: the mean of the ranks' means is the mean loss; the
  // counts add up.
  at::Tensor loss = sums.narrow(0, 0, 1);
  if (mesh_.pp_size() > 1) mesh_.pp().all_reduce(loss, dist::ReduceOp::kSum)->wait();  // the last stage's
  combine_context_parallel(mesh_, sums, counting);
  mesh_.dp().all_reduce(loss, dist::ReduceOp::kAvg)->wait();
  if (counting) {
    at::Tensor counts = sums.narrow(0, 1, 2);
    mesh_.dp().all_reduce(counts, dist::ReduceOp::kSum)->wait();
  }
  at::Tensor host = sums.cpu();
  const double* v = host.data_ptr<double>();
  last_eval_accuracy_ = counting && v[2] > 0 ? std::optional<double>(v[1] / v[2]) : std::nullopt;
  return v[0];
}

double Trainer::evaluate(DataLoader& eval) {
  shard_loader(mesh_, eval, "the evaluation loader");
  const std::vector<int64_t> order = eval.evaluation_order(options_.eval_samples);
  DTRAIN_CHECK(!order.empty(), "evaluation: the held-out dataset has no samples");
  const int64_t rows_per_chunk = eval.options().batch_size;
  const int64_t chunks = (static_cast<int64_t>(order.size()) + rows_per_chunk - 1) / rows_per_chunk;
  const int64_t dp = mesh_.dp_size(), rank = mesh_.dp_rank();
  const int64_t rounds = (chunks + dp - 1) / dp;
  const bool was_training = model_.is_training();
  model_.eval();
  // [row-weighted loss sum, correct predictions, rows], summed on the device: one host read.
  at::Tensor sums = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device_));
  const bool counting = static_cast<bool>(options_.eval_loss_and_correct);
  {
    torch::NoGradGuard no_grad;
    for (int64_t round = 0; round < rounds; ++round) {
      const int64_t chunk = round * dp + rank;
      const bool counts = chunk < chunks;
      // A rank past the last chunk runs the set's first sample so that every rank runs the same
      // forwards; it does not count.
      const int64_t first = counts ? chunk * rows_per_chunk : 0;
      const int64_t rows = counts ? std::min<int64_t>(rows_per_chunk, static_cast<int64_t>(order.size()) - first) : 1;
      Batch batch = eval.load(std::vector<int64_t>(order.begin() + first, order.begin() + first + rows));
      batch.index = chunk;
      const double weight = counts ? static_cast<double>(rows) : 0.0;
      score_batch(batch, weight, sums);
      sums[2].add_(weight);
    }
  }
  model_.train(was_training);
  // The last stage holds the loss (the others add zero); every stage counts the rows.
  if (mesh_.pp_size() > 1) {
    at::Tensor loss = sums.narrow(0, 0, 1);
    mesh_.pp().all_reduce(loss, dist::ReduceOp::kSum)->wait();
  }
  combine_context_parallel(mesh_, sums, counting);
  mesh_.dp().all_reduce(sums, dist::ReduceOp::kSum)->wait();
  at::Tensor host = sums.cpu();
  const double* v = host.data_ptr<double>();
  DTRAIN_CHECK(static_cast<int64_t>(v[2]) == static_cast<int64_t>(order.size()), "evaluation: the ranks scored ",
               v[2], " rows of a ", order.size(), "-sample held-out set (internal error)");
  last_eval_accuracy_ = counting ? std::optional<double>(v[1] / v[2]) : std::nullopt;
  return v[0] / v[2];
}

double Trainer::comm_bus_bytes() const {
  std::vector<const dist::Communicator*> comms = {&mesh_.world()};
  for (const dist::Communicator* c : {&mesh_.dp(), &mesh_.tp(), &mesh_.pp(), &mesh_.cp(), &mesh_.replicas()}) {
    if (std::find(comms.begin(), comms.end(), c) == comms.end()) comms.push_back(c);
  }
  double bytes = 0;
  for (const dist::Communicator* c : comms) bytes += c->traffic().bus_bytes;
  return bytes;
}

StepMetrics Trainer::log_step(bool eval_now, DataLoader* eval, int64_t global_batch,
                              std::chrono::steady_clock::time_point window_start,
                              int64_t window_steps, Progress& progress) {
  StepMetrics m = last_;
  m.loss = read_loss();  // waits for the step's work: the window's time is complete now
  m.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - window_start).count() /
              window_steps;
  m.samples_per_s = m.step_ms > 0 ? global_batch / (m.step_ms / 1000.0) : 0;
  if (options_.tokens_per_sample > 0) m.tokens_per_s = m.samples_per_s * options_.tokens_per_sample;
  // What this rank sent per step over the window, on the mesh's communicators (ring bus bytes).
  const double bus = comm_bus_bytes();
  m.extra["comm_mb"] = (bus - logged_comm_bus_bytes_) / window_steps / (1024.0 * 1024.0);
  logged_comm_bus_bytes_ = bus;
  MemoryStats mem = memory_stats(device_);
  m.mem_allocated_mb = mem.allocated_mb;
  m.mem_peak_mb = std::max(mem.peak_mb, peak_before_report_mb_);  // the run's, across the report step's reset
  if (mesh_.pp_size() > 1) {
    // Rank 0's figures are stage 0's: every stage's peak too (from this rank's pipeline).
    const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble).device(device_);
    at::Tensor peaks = at::empty({mesh_.pp_size()}, f64);
    mesh_.pp().all_gather(at::full({1}, mem.peak_mb, f64), peaks)->wait();
    const at::Tensor host = peaks.cpu();
    for (int s = 0; s < mesh_.pp_size(); ++s) {
      m.extra["mem_peak_mb_stage" + std::to_string(s)] = host.data_ptr<double>()[s];
    }
  }
  m.mem_counter = mem.counter;
  if (scaler_->enabled()) m.loss_scale = scaler_->scale_value();
  if (options_.report_grad_norm && last_grad_norm_.defined()) m.grad_norm = last_grad_norm_.item<double>();
  if (pruner_ && pruner_->active()) m.extra["sparsity"] = pruner_->sparsity();
  if (sparse_reducer_) {  // the logged step's sparse gradients: what moved, what dense would have moved
    const SparseReduceStats& st = sparse_reducer_->last_stats();
    m.extra["sparse_grad_mb"] = static_cast<double>(st.sparse_bytes + st.dense_bytes) / (1024.0 * 1024.0);
    m.extra["sparse_grad_dense_mb"] = static_cast<double>(st.dense_equivalent_bytes) / (1024.0 * 1024.0);
    m.extra["sparse_grad_densified"] = st.densified;
  }
  if (nonfinite_skips_ > 0 || options_.on_nonfinite == NonFinitePolicy::kSkip) {
    m.extra["nonfinite_skips"] = static_cast<double>(nonfinite_skips_);
  }
  if (eval_now) {
    m.eval_loss = evaluate(*eval);
    if (last_eval_accuracy_) m.extra["eval_accuracy"] = *last_eval_accuracy_;
    if (options_.eval_perplexity) m.extra["eval_perplexity"] = std::exp(*m.eval_loss);
  }
  metrics_->write(m);
  tensorboard_->add_metrics(m);
  progress.update(m);
  if (device_.is_cuda() && mesh_.world().rank() == 0 && !options_.progress) {
    LOG(INFO) << gpu_summary_line(device_);
  }
  if (options_.on_log) options_.on_log(m);
  return m;
}

bool Trainer::stop_for_preemption(const DataLoader& train) {
  if (!options_.handle_preemption || !agree_preempt(mesh_.world())) return false;
  if (mesh_.world().rank() == 0) {
    const int signal = preemption_signal();  // 0: another rank got it
    LOG(WARNING) << "preempted (" << (signal ? "signal " + std::to_string(signal) : std::string("a signal to another rank"))
                 << ") after step " << step_
                 << (options_.save_dir.empty() ? "; no --save_dir, nothing saved" : "; saving a checkpoint");
  }
  if (!options_.save_dir.empty()) {
    if (last_saved_step_ == step_) {
      wait_for_save();  // this step's periodic save (possibly in the background) is the checkpoint
    } else {
      save_checkpoint(&train);
    }
  }
  if (mesh_.world().rank() == 0 && !options_.save_dir.empty()) {  // nothing to continue from otherwise
    RequeueResult rq = request_requeue();
    if (rq.attempted) LOG(WARNING) << "requeue: " << rq.message;
  }
  preempted_ = true;
  return true;
}

void Trainer::prepare_loaders(DataLoader& train, DataLoader* eval) {
  // Never two ranks on the same batches: an unsharded loader is sharded here.
  shard_loader(mesh_, train, "the training loader");
  if (eval) shard_loader(mesh_, *eval, "the evaluation loader");
  // The same on every rank (options and dataset are), so every rank refuses together.
  DTRAIN_CHECK(train.options().drop_last || mesh_.dp_size() == 1,
               "Trainer::fit: the training loader has drop_last = false, which gives ranks "
               "unequal (possibly empty) shares of an epoch's last global batch; with ",
               mesh_.dp_size(), " data-parallel ranks set drop_last = true");
  const LoaderOptions& lo = train.options();
  agree_on_settings(mesh_.world(),
                    {{"batch_size", setting_text(lo.batch_size)}, {"drop_last", setting_text(lo.drop_last)},
                     {"shuffle", setting_text(lo.shuffle)}, {"seed", setting_text(lo.seed)},
                     {"batches per epoch", setting_text(train.batches_per_epoch())},
                     {"evaluation", setting_text(eval != nullptr)}},
                    "the training loader of Trainer::fit");
}

void Trainer::save_periodic(const DataLoader& train) {
  if (options_.async_save) {
    {  // Saves more frequent than a write lasts wait here: the timeline shows it apart.
      Timeline::Span span(*timeline_, "checkpoint (wait for the previous write)", category::kCopy, lane::kMain);
      wait_for_save();
    }
    Timeline::Span span(*timeline_, "checkpoint (copy to host)", category::kCopy, lane::kMain);
    save_checkpoint_async(&train);
  } else {
    Timeline::Span span(*timeline_, "checkpoint (write)", category::kCopy, lane::kMain);
    save_checkpoint(&train);
  }
}

StepMetrics Trainer::fit(DataLoader& train, DataLoader* eval) {
  check_can_train();
  prepare_loaders(train, eval);
  Progress progress(options_.steps, options_.progress && mesh_.world().rank() == 0);
  const int64_t global_batch = train.options().batch_size * mesh_.dp_size();
  StepMetrics logged;
  // The evaluation loader's position is saved and restored with the training loader's.
  struct EvalScope {
    DataLoader*& slot;
    ~EvalScope() { slot = nullptr; }
  } eval_scope{eval_};
  eval_ = eval;
  if (options_.resume != ResumeMode::kNo) {
    resume_checkpoint(&train, options_.resume == ResumeMode::kYes);
    // The lines an earlier process logged after the checkpoint it left are logged again now:
    // one line per step in the metrics file.
    metrics_->keep_through_step(step_);
  }
  // TensorBoard: points of steps from here on that earlier processes wrote are superseded.
  tensorboard_->add_resume(step_ + 1);
  if (step_ >= options_.steps) {
    if (mesh_.world().rank() == 0) {
      LOG(WARNING) << "the run is complete: step " << step_ << " of " << options_.steps << " steps was reached"
                   << (options_.save_dir.empty() ? std::string() : " (checkpoint in " + options_.save_dir + ")")
                   << "; nothing to train";
    }
    // Nothing was trained: no loss to report (NaN, never a made-up 0).
    StepMetrics done;
    done.step = step_;
    done.loss = std::numeric_limits<double>::quiet_NaN();
    finish_timeline();
    return done;
  }
  const int64_t first_step = step_ + 1;  // logged too, so a resumed run shows where it starts
  reset_peak_memory(device_);
  peak_before_report_mb_ = 0;
  auto window_start = std::chrono::steady_clock::now();
  int64_t window_steps = 0;
  int64_t window_syncs = 0;
  while (step_ < options_.steps) {
    profiler_->begin_step(step_ + 1);
    Batch batch;
    StepResult r;
    {
      std::optional<SyncCounter> syncs;  // --count_host_syncs: the batch's and the step's
      if (options_.count_host_syncs) syncs.emplace();
      {
        Timeline::Span span(*timeline_, "data", category::kData, lane::kLoader);
        batch = train.next();
      }
      r = step(batch);
      if (syncs) window_syncs += syncs->count();
    }
    ++window_steps;
    const bool eval_now = eval && options_.eval_every > 0 && r.step % options_.eval_every == 0;
    if (r.step == first_step || r.step % options_.log_every == 0 || r.step == options_.steps || eval_now) {
      LOG_IF(INFO, options_.count_host_syncs && mesh_.world().rank() == 0)
          << "host synchronizations with the device: " << window_syncs << " in the " << window_steps
          << " step(s) up to step " << r.step << " (loading and step; the log's own reads not counted)";
      window_syncs = 0;
      // No host sync between log steps: the loss is read here only.
      logged = log_step(eval_now, eval, global_batch, window_start, window_steps, progress);
      if (first_logged_.step == 0) first_logged_ = logged;
      window_start = std::chrono::steady_clock::now();
      window_steps = 0;
    }
    if (!options_.save_dir.empty() && options_.save_every > 0 && r.step % options_.save_every == 0) {
      save_periodic(train);
    }
    profiler_->end_step(r.step);
    if (stop_for_preemption(train)) break;
  }
  progress.finish();
  settle_nonfinite();
  flush_updates();  // the model holds every step's update when fit() returns
  if (!preempted_ && !options_.save_dir.empty() && last_saved_step_ != step_) save_checkpoint(&train);
  wait_for_save();  // every checkpoint of fit() is published when it returns
  finish_timeline();
  return logged;
}

void Trainer::record_step_timeline(std::chrono::steady_clock::time_point start) {
  if (!timeline_->enabled()) return;
  auto end = std::chrono::steady_clock::now();
  ReducerStepStats s = reducer_->last_step_stats();
  const std::string collective = reducer_->bucket_comm().name();
  for (size_t k = 0; k < s.bucket_start.size(); ++k) {
    TraceArgs args = {{"bucket", static_cast<double>(k)},
                      {"bytes", k < s.bucket_bytes.size() ? static_cast<double>(s.bucket_bytes[k]) : 0.0}};
    if (k < s.bucket_launch.size()) {
      timeline_->add_instant("enqueue " + collective, category::kComm, lane::kComm, s.bucket_launch[k], args);
    }
    timeline_->add_complete(collective, category::kComm, lane::kComm, s.bucket_start[k], s.bucket_end[k], args);
  }
  // ZeRO-3: each unit's gathers (on the comm lane: hidden where a computation overlaps them) and
  // its computations, forward and backward, on a lane of their own.
  if (units_) {
    for (const ParameterUnits::Event& e : units_->take_events()) {
      const TraceArgs args = {{"unit", static_cast<double>(e.unit)}};
      if (e.name == "gather") {
        timeline_->add_complete("gather unit", category::kComm, lane::kComm, e.start, e.end, args);
      } else {
        timeline_->add_complete("unit " + e.name, category::kCompute, lane::kUnits, e.start, e.end, args);
      }
    }
  }
  // Context parallelism: each ring step's block computation and each exchange (launch to the
  // end of its wait; hidden where a computation overlaps it).
  if (mesh_.cp_size() > 1) {
    for (const RingEvent& e : take_ring_events()) {
      const bool exchange = e.name == "ring exchange";
      timeline_->add_complete(e.name, exchange ? category::kComm : category::kCompute, lane::kRing, e.start, e.end,
                              {{"ring_step", static_cast<double>(e.step)}});
    }
  }
  // A host update (optimizer offload); a delayed one ran during this step's forward and backward.
  while (auto t = optimizer_->take_update_timing()) {
    timeline_->add_complete(t->background ? "cpu update (delayed)" : "cpu update", category::kOptimizer,
                            lane::kOptimizer, t->start, t->end);
  }
  TraceArgs args = {{"step", static_cast<double>(step_)}, {"accum_steps", static_cast<double>(accum_steps_)}};
  if (options_.pipeline.schedule == PipelineSchedule::kInterleaved && mesh_.pp_size() > 1) {
    args.emplace("pp_chunks", static_cast<double>(options_.pipeline.chunks));  // the bubble's theory
  }
  timeline_->add_complete("step", category::kCompute, lane::kMain, start, end, args);
}

void Trainer::finish_timeline() {
  if (!timeline_->enabled()) return;
  timeline_->write();
  dist::Communicator& world = mesh_.world();
  world.barrier()->wait();
  if (world.rank() != 0) return;
  std::vector<std::string> files;
  for (int r = 0; r < world.size(); ++r) {
    files.push_back(timeline_path_for_rank(options_.timeline_path, r, world.size()));
  }
  if (world.size() > 1) merge_timelines(files, options_.timeline_path);
  const std::vector<TraceEvent> events = read_timeline(options_.timeline_path);
  LOG(INFO) << "timeline written to " << options_.timeline_path << ": " << summarize_overlap(events).to_string();
  if (mesh_.pp_size() > 1) LOG(INFO) << "pipeline stages:\n" << to_string(summarize_pipeline(events));
  const std::string offload = summarize_offload(events).to_string();
  if (!offload.empty()) LOG(INFO) << offload;
}

}  // namespace dtrain::engine
