#include "common.h"

#include "datasets.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <glog/logging.h>
#include <torch/utils.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/logging.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/train/agreement.h"
#include "dtrain/engine/train/preemption.h"

// Run
DEFINE_int64(steps, 100, "optimizer steps to train");
DEFINE_int64(batch_size, 64, "samples per data-parallel rank per optimizer step");
DEFINE_double(lr, 1e-3, "base learning rate");
DEFINE_int64(seed, 0, "random seed (model init, data order, dropout)");
DEFINE_string(device, "auto", "auto, cpu or cuda");
DEFINE_string(amp, "off", "mixed precision: off, bf16 or fp16 (with dynamic loss scaling)");
DEFINE_int32(accum_steps, 1, "micro-batches accumulated per step (must divide --batch_size)");
DEFINE_int32(tp, 1, "tensor-parallel size (consecutive ranks form a group)");
DEFINE_bool(sequence_parallel, false,
            "with --tp: split activations between the tensor-parallel layers along the sequence "
            "(--seq_len must divide by --tp; no effect with --tp=1)");
DEFINE_bool(checkpoint_activations, false, "recompute each block's activations in backward");
DEFINE_string(offload, "none", "none, optimizer, layers or all");
DEFINE_string(plan, "none", "none, or auto: choose checkpointing/accumulation/offload to fit --gpu_mem_limit_gb");
DEFINE_double(gpu_mem_limit_gb, 0, "GPU memory budget in GiB, CUDA context included (0: the whole device); caps the caching allocator");
DEFINE_double(host_mem_limit_gb, 0, "cap of pinned host memory for offload (0: none besides what the machine has free)");
DEFINE_int32(offload_threads, 0, "CPU optimizer threads (0: OMP_NUM_THREADS or the cores)");
DEFINE_string(offload_stream_gradients, "auto",
              "with --offload=optimizer: copy each reduced gradient bucket to the host during backward "
              "(auto: on a GPU; on: on the CPU too; off)");
DEFINE_bool(offload_reduce_to_owner, true,
            "with --offload=optimizer and data parallelism: reduce each gradient only to the rank whose "
            "optimizer shard holds it instead of all-reducing it");
DEFINE_int64(offload_delayed_update_after, -1,
             "with --offload=optimizer: after this many ordinary steps, run each step's CPU update "
             "during the next step's forward/backward (one-step-delayed update; -1: off)");
DEFINE_int32(workers, 2, "data-loading worker threads");
DEFINE_int64(eval_every, 0, "evaluate every N steps (0: never)");
DEFINE_int64(log_every, 10, "log metrics every N steps");
DEFINE_string(metrics, "", "write metrics as JSON lines to this file (rank 0)");
DEFINE_string(save_dir, "", "save checkpoints to this directory");
DEFINE_bool(resume, false, "resume from the newest good checkpoint in --save_dir");
DEFINE_int64(save_every, 0, "save a checkpoint every N steps (0: at the end and on preemption only)");
DEFINE_int32(keep_last, 3, "checkpoints kept in --save_dir (0: all)");
DEFINE_string(tensorboard_dir, "", "write TensorBoard event files here (rank 0)");
DEFINE_string(timeline, "", "write a Chrome trace of the run to this file (per-rank files merged by rank 0)");
DEFINE_int64(memory_report_step, 0, "log where memory goes after this step (0: never)");
DEFINE_int32(collective_timeout_s, 300, "seconds before a stuck collective ends the job");
DEFINE_string(backend, "auto", "communicator backend: auto, mpi, nccl, local");
DEFINE_string(optimizer, "", "sgd, adam, adamw or adagrad (default: the example's)");
DEFINE_double(weight_decay, 0.0, "weight decay");
DEFINE_double(clip_grad_norm, 0.0, "clip gradients to this global norm (0: off)");
DEFINE_string(on_nonfinite, "stop",
              "a non-finite loss or gradient norm (fp32/bf16): stop (before the update, naming the newest "
              "checkpoint) or skip (drop the step on every rank)");
DEFINE_int32(max_nonfinite_skips, 10, "with --on_nonfinite=skip: stop after this many non-finite steps in a row");
DEFINE_string(schedule, "constant", "learning-rate schedule: constant, cosine or linear");
DEFINE_int64(warmup_steps, 0, "linear learning-rate warm-up steps");
DEFINE_string(data, "real", "real (files that installed packages ship) or synthetic");
DEFINE_string(data_path, "", "data file or directory (default: the example's)");
DEFINE_int64(eval_batches, 4, "batches per evaluation");
DEFINE_int32(prefetch, 2, "batches prepared ahead by the loader");
DEFINE_bool(inplace, true, "in-place activations where safe");
DEFINE_bool(progress, true, "progress bar / periodic lines on rank 0");
DEFINE_bool(eval_only, false, "only evaluate --eval_batches batches under no_grad (memory/speed of inference)");
// Model shape
DEFINE_int64(hidden, 256, "MLP: hidden width");
DEFINE_int32(depth, 3, "MLP: hidden layers");
DEFINE_int64(d_model, 512, "transformers: model width");
DEFINE_int64(heads, 8, "transformers: attention heads");
DEFINE_int32(layers, 4, "transformers: layers (seq2seq: per encoder and decoder)");
DEFINE_int64(ff, 2048, "transformers: feed-forward width");
DEFINE_int64(seq_len, 256, "transformers: sequence length");
DEFINE_int64(vocab, 32000, "transformers: vocabulary size");
DEFINE_double(dropout, 0.1, "transformers: dropout probability");

namespace dtrain::examples {
namespace {

void check_flags() {
  DTRAIN_CHECK(FLAGS_steps >= 0, "--steps=", FLAGS_steps, " must be >= 0");
  DTRAIN_CHECK(FLAGS_batch_size >= 1, "--batch_size=", FLAGS_batch_size, " must be >= 1");
  DTRAIN_CHECK(std::isfinite(FLAGS_lr) && FLAGS_lr > 0, "--lr=", FLAGS_lr,
               " must be a positive finite number");
  DTRAIN_CHECK(FLAGS_accum_steps >= 1, "--accum_steps=", FLAGS_accum_steps, " must be >= 1");
  DTRAIN_CHECK(FLAGS_batch_size % FLAGS_accum_steps == 0, "--batch_size=", FLAGS_batch_size,
               " is not a multiple of --accum_steps=", FLAGS_accum_steps,
               "; each micro-batch must have the same size");
  DTRAIN_CHECK(FLAGS_workers >= 0, "--workers=", FLAGS_workers, " must be >= 0");
  DTRAIN_CHECK(FLAGS_prefetch >= 1, "--prefetch=", FLAGS_prefetch, " must be >= 1");
  DTRAIN_CHECK(FLAGS_log_every >= 1, "--log_every=", FLAGS_log_every, " must be >= 1");
  DTRAIN_CHECK(FLAGS_eval_every >= 0, "--eval_every=", FLAGS_eval_every, " must be >= 0");
  DTRAIN_CHECK(FLAGS_collective_timeout_s > 0, "--collective_timeout_s=",
               FLAGS_collective_timeout_s, " must be positive");
  DTRAIN_CHECK(FLAGS_data == "real" || FLAGS_data == "synthetic", "--data=", FLAGS_data,
               " is not one of: real, synthetic");
  DTRAIN_CHECK(FLAGS_hidden >= 1 && FLAGS_depth >= 0 && FLAGS_d_model >= 1 && FLAGS_heads >= 1 &&
                   FLAGS_layers >= 1 && FLAGS_ff >= 1 && FLAGS_seq_len >= 1 && FLAGS_vocab >= 2,
               "model sizes must be positive (--hidden, --depth, --d_model, --heads, --layers, "
               "--ff, --seq_len, --vocab)");
  DTRAIN_CHECK(FLAGS_d_model % FLAGS_heads == 0, "--d_model=", FLAGS_d_model,
               " is not divisible by --heads=", FLAGS_heads);
  DTRAIN_CHECK(FLAGS_dropout >= 0 && FLAGS_dropout < 1, "--dropout=", FLAGS_dropout,
               " must be in [0, 1)");
  if (!FLAGS_optimizer.empty()) {
    engine::OptimizerOptions o;
    o.name = FLAGS_optimizer;
    o.lr = FLAGS_lr;
    o.weight_decay = FLAGS_weight_decay;
    if (o.name == "sgd") o.momentum = 0.9;
    engine::validate(o);
  }
  engine::ScheduleOptions sched;
  sched.name = FLAGS_schedule;
  sched.warmup_steps = FLAGS_warmup_steps;
  sched.total_steps = FLAGS_steps;
  engine::validate(sched);
  // Flags of features that arrive with later parts of the engine: refuse rather than ignore.
  engine::parse_offload(FLAGS_offload);  // validates
  DTRAIN_CHECK(FLAGS_plan == "none" || FLAGS_plan == "auto", "--plan=", FLAGS_plan, " is not one of: none, auto");
  DTRAIN_CHECK(FLAGS_gpu_mem_limit_gb >= 0, "--gpu_mem_limit_gb=", FLAGS_gpu_mem_limit_gb, " must be >= 0");
  DTRAIN_CHECK(FLAGS_plan != "auto" || FLAGS_gpu_mem_limit_gb > 0, "--plan=auto needs --gpu_mem_limit_gb (the budget to fit)");
  DTRAIN_CHECK(FLAGS_host_mem_limit_gb >= 0, "--host_mem_limit_gb=", FLAGS_host_mem_limit_gb, " must be >= 0");
  engine::parse_stream_gradients(FLAGS_offload_stream_gradients);  // validates
  engine::parse_on_nonfinite(FLAGS_on_nonfinite);                   // validates
  DTRAIN_CHECK(FLAGS_max_nonfinite_skips >= 1, "--max_nonfinite_skips=", FLAGS_max_nonfinite_skips, " must be >= 1");
  DTRAIN_CHECK(FLAGS_offload_delayed_update_after >= -1, "--offload_delayed_update_after=",
               FLAGS_offload_delayed_update_after, " must be >= 0 (warm-up steps) or -1 (off)");
  DTRAIN_CHECK(FLAGS_offload_delayed_update_after < 0 || engine::parse_offload(FLAGS_offload).optimizer,
               "--offload_delayed_update_after needs --offload=optimizer or --offload=all");
  DTRAIN_CHECK(FLAGS_save_every >= 0, "--save_every=", FLAGS_save_every, " must be >= 0");
  DTRAIN_CHECK(FLAGS_keep_last >= 0, "--keep_last=", FLAGS_keep_last, " must be >= 0");
}

// POSIX rather than std::filesystem: libtorch.so exports its own copies of some
// std::filesystem functions, and programs linking it bind to them.
bool is_directory(const std::string& dir) {
  struct stat st {};
  return stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string parent_directory(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void check_writable_file(const std::string& path, const char* flag) {
  if (path.empty()) return;
  std::string dir = parent_directory(path);
  DTRAIN_CHECK(is_directory(dir), "--", flag, "=", path, ": directory '",
               dir, "' does not exist; create it first");
}

}  // namespace

namespace {

// The program's flags that must be the same on every rank: every flag this program defines
// except those that may legitimately differ per rank (docs/CLUSTER.md lists them).
engine::Settings flags_that_must_agree() {
  static const std::set<std::string> per_rank = {
      "workers", "prefetch", "progress", "log_every", "metrics", "tensorboard_dir", "timeline",
      "memory_report_step", "data_path", "collective_timeout_s", "host_mem_limit_gb", "offload_threads"};
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);
  engine::Settings out;
  for (const auto& f : flags) {
    if (f.filename.find("examples/") == std::string::npos || per_rank.count(f.name)) continue;
    out.emplace_back("--" + f.name, f.current_value);
  }
  return out;
}

}  // namespace

Run init_run(int argc, char** argv, const std::string& usage,
             const std::map<std::string, std::string>& defaults,
             const std::function<void()>& model_checks) {
  for (auto& [name, value] : defaults) {
    gflags::SetCommandLineOptionWithMode(name.c_str(), value.c_str(), gflags::SET_FLAGS_DEFAULT);
  }
  gflags::SetUsageMessage(usage);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  DTRAIN_CHECK(argc == 1, "unexpected argument '", argc > 1 ? argv[1] : "",
               "'; flags are written --name=value");
  engine::install_preemption_handlers();  // SIGTERM/SIGUSR1: save at the end of the step
  engine::track_cpu_memory();  // exact CPU tensor memory in the metrics
  Run run;
  std::string argv0 = argv[0];
  run.program = argv0.substr(argv0.rfind('/') == std::string::npos ? 0 : argv0.rfind('/') + 1);
  run.world = dist::detect_world();
  dist::init_logging(argv[0], run.world);
  check_flags();
  check_writable_file(FLAGS_metrics, "metrics");
  check_writable_file(FLAGS_timeline, "timeline");
  engine::OffloadChoice offload = engine::parse_offload(FLAGS_offload);
  DTRAIN_CHECK(!offload.layers || model_checks, "--offload=", FLAGS_offload, ": ", run.program,
               " has no offloadable layers (train_gpt streams its blocks); use --offload=optimizer");
  DTRAIN_CHECK(!(offload.layers && offload.optimizer) || FLAGS_tp == 1,
               "--offload=all needs --tp=1 (use --offload=layers or optimizer with tensor parallelism)");
  DTRAIN_CHECK(model_checks || FLAGS_tp == 1, "--tp=", FLAGS_tp, ": ", run.program,
               " has no tensor-parallel layers; use train_gpt for tensor parallelism");
  DTRAIN_CHECK(model_checks || !FLAGS_sequence_parallel, "--sequence_parallel: ", run.program,
               " has no tensor-parallel layers; use train_gpt for sequence parallelism");
  dist::Mesh::check(run.world.size, FLAGS_tp);
  if (model_checks) model_checks();
  run.device = dist::select_device(run.world, dist::parse_device_request(FLAGS_device));
  engine::parse_amp(FLAGS_amp);  // validates
  dist::CommOptions options;
  options.timeout = std::chrono::seconds(FLAGS_collective_timeout_s);
  run.comm = dist::create_communicator(FLAGS_backend, run.world, run.device, options);
  // Before the mesh splits the world by --tp and before anything depends on the flags.
  engine::agree_on_settings(*run.comm, flags_that_must_agree(), "command-line flags");
  run.mesh = std::make_unique<dist::Mesh>(*run.comm, FLAGS_tp);
  torch::manual_seed(static_cast<uint64_t>(FLAGS_seed));
  if (run.world.rank == 0) {
    LOG(INFO) << run.program << ": " << run.world.size << " rank(s) (tp " << run.mesh->tp_size()
              << " x dp " << run.mesh->dp_size() << "), device " << run.device << ", backend "
              << run.comm->backend() << ", amp " << FLAGS_amp;
  }
  return run;
}

engine::TrainerOptions trainer_options(const Run& run, const std::string& default_optimizer) {
  engine::TrainerOptions o;
  o.steps = FLAGS_steps;
  o.accum_steps = FLAGS_accum_steps;
  o.amp = engine::parse_amp(FLAGS_amp);
  o.optimizer.name = FLAGS_optimizer.empty() ? default_optimizer : FLAGS_optimizer;
  o.optimizer.lr = FLAGS_lr;
  o.optimizer.weight_decay = FLAGS_weight_decay;
  if (o.optimizer.name == "sgd") o.optimizer.momentum = 0.9;
  if (o.optimizer.name == "adagrad") o.optimizer.eps = 1e-10;
  o.schedule.name = FLAGS_schedule;
  o.schedule.warmup_steps = FLAGS_warmup_steps;
  o.schedule.total_steps = FLAGS_steps;
  o.clip_grad_norm = FLAGS_clip_grad_norm;
  o.on_nonfinite = engine::parse_on_nonfinite(FLAGS_on_nonfinite);
  o.max_nonfinite_skips = FLAGS_max_nonfinite_skips;
  o.log_every = FLAGS_log_every;
  o.eval_every = FLAGS_eval_every;
  o.eval_batches = FLAGS_eval_batches;
  o.metrics_path = FLAGS_metrics;
  o.tensorboard_dir = FLAGS_tensorboard_dir;
  o.timeline_path = FLAGS_timeline;
  o.memory_report_step = FLAGS_memory_report_step;
  o.offload_optimizer = engine::parse_offload(FLAGS_offload).optimizer;
  o.offload.host_mem_limit_gb = FLAGS_host_mem_limit_gb;
  o.offload.threads = FLAGS_offload_threads;
  o.offload.stream_gradients = FLAGS_offload_stream_gradients;
  o.offload.delayed_update_after = FLAGS_offload_delayed_update_after;
  o.offload.reduce_to_owner = FLAGS_offload_reduce_to_owner;
  o.save_dir = FLAGS_save_dir;
  o.save_every = FLAGS_save_every;
  o.keep_last = FLAGS_keep_last;
  o.resume = FLAGS_resume;
  o.checkpoint_meta["program"] = run.program;
  o.progress = FLAGS_progress;
  o.oom_backoff = run.mesh->tp_size() == 1;
  return o;
}

engine::LoaderOptions loader_options(const Run& run, int64_t batch_size, bool shuffle, uint64_t seed) {
  engine::LoaderOptions o;
  o.batch_size = batch_size;
  o.dp_rank = run.mesh->dp_rank();
  o.dp_size = run.mesh->dp_size();
  o.shuffle = shuffle;
  o.seed = seed;
  o.workers = FLAGS_workers;
  o.prefetch = FLAGS_prefetch;
  o.device = run.device;
  return o;
}

int guarded_main(const char* program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const Preempted&) {
    return kExitRequeue;
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return kExitUsage;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what_without_backtrace());
    return kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return kExitFailure;
  }
}

void report(const Run& run, const engine::StepMetrics& first, const engine::StepMetrics& last) {
  if (run.world.rank != 0) return;
  std::printf("%s: trained %lld steps on %d rank(s): loss %.4f (step %lld) -> %.4f (step %lld), "
              "%.1f ms/step, %.0f samples/s, peak memory %.0f MB\n",
              run.program.c_str(), static_cast<long long>(last.step), run.world.size, first.loss,
              static_cast<long long>(first.step), last.loss, static_cast<long long>(last.step),
              last.step_ms, last.samples_per_s, last.mem_peak_mb);
  std::fflush(stdout);
}

engine::StepMetrics fit_and_report(const Run& run, engine::Trainer& trainer, engine::DataLoader& train,
                                   engine::DataLoader* eval) {
  if (!FLAGS_eval_only) {
    DTRAIN_CHECK(FLAGS_eval_every == 0 || eval, run.program, " has no held-out data to evaluate on; drop --eval_every");
    engine::StepMetrics last = trainer.fit(train, FLAGS_eval_every > 0 ? eval : nullptr);
    if (trainer.preempted()) {
      if (run.world.rank == 0) {
        std::printf("%s: preempted at step %lld; checkpoint saved, exiting with %d to be requeued\n",
                    run.program.c_str(), static_cast<long long>(trainer.current_step()), kExitRequeue);
      }
      std::fflush(stdout);
      throw Preempted();
    }
    report(run, trainer.first_logged(), last);
    return last;
  }
  engine::DataLoader& data = eval ? *eval : train;
  trainer.evaluate(data, 1);  // warm-up
  engine::reset_peak_memory(run.device);
  auto t0 = std::chrono::steady_clock::now();
  double loss = trainer.evaluate(data, FLAGS_eval_batches);
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
              FLAGS_eval_batches;
  engine::MemoryStats mem = engine::memory_stats(run.device);
  if (run.world.rank == 0) {
    std::printf("%s: evaluated %lld batches under no_grad: loss %.4f, %.1f ms/batch, peak memory %.0f MB\n",
                run.program.c_str(), static_cast<long long>(FLAGS_eval_batches), loss, ms, mem.peak_mb);
  }
  return engine::StepMetrics();
}

ClassificationData classification_data() {
  at::Tensor x, y;
  if (FLAGS_data == "synthetic") {
    std::tie(x, y) = synthetic_classification(4096, 64, 10, 1234);
  } else {
    std::tie(x, y) = load_digits(FLAGS_data_path.empty() ? sklearn_data_dir() + "/digits.csv.gz" : FLAGS_data_path);
  }
  ClassificationData d;
  d.features = x.size(1);
  d.eval_rows = x.size(0) / 5;
  const int64_t n_train = x.size(0) - d.eval_rows;
  d.train = std::make_shared<engine::TensorDataset>(
      std::vector<at::Tensor>{x.narrow(0, 0, n_train), y.narrow(0, 0, n_train)});
  d.eval = std::make_shared<engine::TensorDataset>(
      std::vector<at::Tensor>{x.narrow(0, n_train, d.eval_rows), y.narrow(0, n_train, d.eval_rows)});
  return d;
}

namespace {

std::unique_ptr<engine::DataLoader> held_out_loader(const Run& run, std::shared_ptr<engine::Dataset> data) {
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(FLAGS_batch_size, data->size() / run.mesh->dp_size()));
  return std::make_unique<engine::DataLoader>(std::move(data), loader_options(run, rows, false, FLAGS_seed));
}

}  // namespace

std::unique_ptr<engine::DataLoader> eval_loader(const Run& run, const ClassificationData& data) {
  return held_out_loader(run, data.eval);
}

std::unique_ptr<engine::DataLoader> eval_loader(const Run& run, const TokenData& data) {
  return held_out_loader(run, data.eval);
}

TokenData token_data(const Run& run, int64_t window_len, bool fold_bytes) {
  if (FLAGS_data == "synthetic") {
    const int64_t count = std::max<int64_t>(1024, 4 * FLAGS_batch_size * run.world.size);
    return {synthetic_tokens(count, window_len, FLAGS_vocab, 4321),
            synthetic_tokens(std::max<int64_t>(64, FLAGS_batch_size * run.world.size), window_len, FLAGS_vocab,
                             8765)};
  }
  DTRAIN_CHECK(fold_bytes || FLAGS_vocab >= 256, "--vocab=", FLAGS_vocab,
               " is too small for byte tokens of the text corpus (needs >= 256)");
  const std::string path = FLAGS_data_path.empty() ? text_corpus_dir() : FLAGS_data_path;
  at::Tensor bytes = load_text_bytes(path);
  if (FLAGS_vocab < 256) bytes = at::remainder(bytes.to(at::kLong), FLAGS_vocab);
  const int64_t n = bytes.numel(), held = std::max<int64_t>(n / 10, window_len + 1);
  DTRAIN_CHECK(n - held >= window_len + 1, path, " has ", n, " tokens: too few for windows of ", window_len + 1,
               " tokens to train on and ", held, " held out for evaluation; use more text or a shorter --seq_len");
  const int64_t stride = std::max<int64_t>(1, FLAGS_seq_len / 2);
  return {std::make_shared<TokenWindows>(bytes.narrow(0, 0, n - held), window_len, stride),
          std::make_shared<TokenWindows>(bytes.narrow(0, n - held, held), window_len, stride)};
}

std::string sklearn_data_dir() {
  return std::string(DTRAIN_SITE_PACKAGES) + "/sklearn/datasets/data";
}

std::string text_corpus_dir() { return "/usr/share/common-licenses"; }

}  // namespace dtrain::examples
