#include "dtrain/engine/train/cli.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>

#include <c10/util/Exception.h>
#include <gflags/gflags.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/observe/profiler.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/engine/train/agreement.h"

namespace dtrain::engine::cli {
namespace {

PruneOptions prune_options(const Flags& f) {
  PruneOptions o;
  o.amount = f.prune_amount;
  o.scope = f.prune_scope;
  o.at_step = f.prune_at_step;
  if (!f.prune_steps.empty()) {
    const ProfileSteps range = parse_step_range(f.prune_steps, "--prune_steps");
    DTRAIN_CHECK(range.last > range.first, "--prune_steps=", f.prune_steps,
                 ": gradual pruning needs a range A-B with A < B (one step: --prune_at_step)");
    o.from_step = range.first;
    o.to_step = range.last;
  }
  return o;
}

// "a,b,c" -> {"a", "b", "c"}; an empty item is a dtrain::Error naming the flag.
std::vector<std::string> split_list(const std::string& text, const char* flag) {
  std::vector<std::string> items;
  std::string item;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i < text.size() && text[i] != ',') {
      item += text[i];
      continue;
    }
    DTRAIN_CHECK(!item.empty(), flag, "=", text, ": an empty item; give a comma-separated list such as a.,b.");
    items.push_back(item);
    item.clear();
  }
  return items;
}

// The file name gflags records for the standard flags (--helpfull groups by it).
constexpr const char* kFile = "dtrain/engine/train/cli.cc";

Flags g_values;    // gflags writes the parsed values here
Flags g_defaults;  // and keeps the defaults here

struct Spec {
  Topic topic;
  const char* name;
  const char* help;
  std::function<void()> register_flag;
  unsigned reach = 0;  // Reach bits: which of trainer_options, loader_options, run_options read it
};

template <typename T>
Spec spec(Topic topic, const char* name, const char* help, T Flags::*member, unsigned reach = kToTrainer) {
  return {topic, name, help, [=] {
            gflags::FlagRegisterer(name, help, kFile, &(g_values.*member), &(g_defaults.*member));
          }, reach};
}

// The flags by topic (the order of --help within a topic).
std::vector<Spec> training_specs() {
  return {
    spec(kTraining, "steps", "optimizer steps to train", &Flags::steps),
    spec(kTraining, "batch_size", "samples per data-parallel rank per optimizer step", &Flags::batch_size, kToRun),
    spec(kTraining, "lr", "base learning rate", &Flags::lr),
    spec(kTraining, "seed", "random seed (model init, data order, dropout)", &Flags::seed, kToLoader | kToRun),
    spec(kTraining, "optimizer", "sgd, adam, adamw or adagrad (default: the program's)", &Flags::optimizer),
    spec(kTraining, "weight_decay", "weight decay", &Flags::weight_decay),
    spec(kTraining, "clip_grad_norm", "clip gradients to this global norm (0: off)", &Flags::clip_grad_norm),
    spec(kTraining, "schedule", "learning-rate schedule: constant, cosine or linear", &Flags::schedule),
    spec(kTraining, "warmup_steps", "linear learning-rate warm-up steps", &Flags::warmup_steps),
    spec(kTraining, "accum_steps", "micro-batches accumulated per step (must divide --batch_size)",
         &Flags::accum_steps),
    spec(kTraining, "amp", "mixed precision: off, bf16 or fp16 (with dynamic loss scaling)", &Flags::amp),
    spec(kTraining, "param_dtype",
         "the trained weights' dtype: float32, or bfloat16 (gradients in bfloat16 too; needs --offload=optimizer "
         "or --shard, which keep the float32 master weights)",
         &Flags::param_dtype),
    spec(kTraining, "cuda_graph",
         "on CUDA, replay the model's forward and backward from CUDA graphs captured at step 3 (the host no "
         "longer launches each kernel); refused with a logged reason where the capture cannot hold",
         &Flags::cuda_graph),
    spec(kTraining, "on_nonfinite",
         "a non-finite loss or gradient norm: stop (before the update, naming the newest checkpoint) "
         "or skip the step",
         &Flags::on_nonfinite),
    spec(kTraining, "max_nonfinite_skips", "with --on_nonfinite=skip: stop after this many in a row",
         &Flags::max_nonfinite_skips),
    spec(kTraining, "prune_amount", "magnitude pruning: fraction of the Linear/Conv weights set to zero (0: off)",
         &Flags::prune_amount),
    spec(kTraining, "prune_scope", "pruning per weight tensor (layer) or over all of them (global)",
         &Flags::prune_scope),
    spec(kTraining, "prune_at_step", "prune once, before this step", &Flags::prune_at_step),
    spec(kTraining, "prune_steps", "A-B: prune gradually from step A to B (Zhu & Gupta's cubic schedule)",
         &Flags::prune_steps),
  };
}

std::vector<Spec> layout_and_data_specs() {
  return {
    spec(kRanks, "device", "auto, cpu or cuda (each rank its GPU: local rank modulo the GPUs)", &Flags::device, kToRun),
    spec(kRanks, "backend", "communicator: auto, nccl, mpi or local", &Flags::backend, kToRun),
    spec(kRanks, "collective_timeout_s", "seconds before a stuck collective ends the job",
         &Flags::collective_timeout_s, kToRun),
    spec(kTensorParallel, "tp", "tensor-parallel size (consecutive ranks form a group)", &Flags::tp, kToRun),
    spec(kTensorParallel, "sequence_parallel",
         "with --tp > 1: split the activations between the parallel layers along the sequence",
         &Flags::sequence_parallel, kToRun),
    spec(kTensorParallel, "pp", "pipeline stages (consecutive blocks per stage; stages are the outermost ranks)",
         &Flags::pp, kToRun),
    spec(kTensorParallel, "cp",
         "context-parallel size: each rank of a group holds 1/cp of every sequence (ring attention; "
         "--seq_len a multiple of 2 cp)",
         &Flags::cp, kToRun),
    spec(kTensorParallel, "pp_schedule", "with --pp > 1: 1f1b, gpipe, zb (zero bubble: the weight gradients deferred into the bubble) or interleaved (--pp_chunks virtual stages per rank)", &Flags::pp_schedule),
    spec(kTensorParallel, "pp_chunks", "with --pp_schedule=interleaved: model chunks per stage (stage s holds virtual stages s, s + pp, ...; bubble (pp - 1) / (chunks x micro-batches))",
         &Flags::pp_chunks, kToTrainer),
    spec(kTensorParallel, "pp_zb_costs",
         "with --pp_schedule=zb: the forward, input-gradient and weight-gradient costs F,B,W its lists are ordered at "
         "(ratios; dtrain-plan --simulate prints them for a zb layout)",
         &Flags::pp_zb_costs, kToTrainer),
    spec(kTensorParallel, "pp_blocks", "with --pp > 1: blocks per stage, e.g. 2,4,4,2 (default: even, extra from stage 1)",
         &Flags::pp_blocks, kToTrainer | kToRun),
    spec(kData, "workers", "data-loading worker threads", &Flags::workers, kToLoader),
    spec(kData, "prefetch", "batches prepared ahead by the loader", &Flags::prefetch, kToLoader),
    spec(kData, "eval_every", "evaluate every N steps (0: never)", &Flags::eval_every),
    spec(kData, "eval_samples",
         "held-out samples each evaluation scores, the same ones every time and for any rank count (0: all)",
         &Flags::eval_samples),
  };
}

std::vector<Spec> memory_checkpoint_and_observability_specs() {
  return {
    spec(kMemory, "offload", "none, optimizer, layers or all", &Flags::offload, kToTrainer | kToRun),
    spec(kMemory, "shard",
         "partition across the data-parallel group: none, optimizer (ZeRO-1: optimizer state and "
         "master weights), gradients (ZeRO-2: also gradients) or parameters (ZeRO-3: also weights)",
         &Flags::shard),
    spec(kMemory, "shard_units",
         "with --shard=parameters: the units gathered whole, as parameter-name prefixes (the first parameter under "
         "each begins a unit), e.g. wte.,blocks.0.,blocks.1.,ln_f. (default: the model's own)",
         &Flags::shard_units),
    spec(kMemory, "offload_threads", "CPU optimizer threads (0: OMP_NUM_THREADS or the cores)",
         &Flags::offload_threads),
    spec(kMemory, "offload_stream_gradients",
         "with --offload=optimizer: copy each gradient bucket to the host as it is reduced: auto, on, off",
         &Flags::offload_stream_gradients),
    spec(kMemory, "offload_reduce_to_owner",
         "with --offload=optimizer: reduce each gradient only to the rank that updates it",
         &Flags::offload_reduce_to_owner),
    spec(kMemory, "offload_delayed_update_after",
         "with --offload=optimizer, all or layers: after N steps overlap the CPU update with the next step (-1: off)",
         &Flags::offload_delayed_update_after),
    spec(kMemory, "host_mem_limit_gb", "cap of pinned host memory for offload (0: none)", &Flags::host_mem_limit_gb),
    spec(kMemory, "plan", "none, or auto: choose checkpointing/accumulation/offload to fit --gpu_mem_limit_gb",
         &Flags::plan, kToRun),
    spec(kMemory, "gpu_mem_limit_gb", "GPU memory budget in GiB, CUDA context included (0: the whole device)",
         &Flags::gpu_mem_limit_gb, kToRun),
    spec(kMemory, "plan_cluster",
         "with --plan=auto (gpt, llama): rank the candidates by the step-time simulator with this cluster file "
         "(dtrain-plan --calibrate writes it); empty: by the activation probe's timings",
         &Flags::plan_cluster, kToRun),
    spec(kMemory, "memory_report_step", "log where memory goes after this step (0: never)",
         &Flags::memory_report_step),
    spec(kMemory, "checkpoint_activations", "recompute each block's activations in backward",
         &Flags::checkpoint_activations, kToTrainer | kToRun),
    spec(kMemory, "checkpoint_blocks",
         "with --checkpoint_activations: recompute only the first N blocks of each pipeline stage, keep the "
         "others' activations (a faster step that keeps more memory; -1: every block)",
         &Flags::checkpoint_blocks, kToTrainer | kToRun),
    spec(kCheckpoints, "save_dir", "save checkpoints to this directory (one run per directory)", &Flags::save_dir),
    spec(kCheckpoints, "save_every", "also save every N steps (0: at the end and on preemption only)",
         &Flags::save_every),
    spec(kCheckpoints, "keep_last", "checkpoints kept in --save_dir (0: all)", &Flags::keep_last),
    spec(kCheckpoints, "resume",
         "continue from the newest good checkpoint in --save_dir: yes (one must exist; a bare --resume), "
         "auto (if there is one, else start), no",
         &Flags::resume),
    spec(kCheckpoints, "save_dir_exists",
         "a fresh start (--resume=no) into a --save_dir holding checkpoints: error, overwrite (remove them) or "
         "resume (continue from them)",
         &Flags::save_dir_exists),
    spec(kCheckpoints, "async_save", "periodic saves write in the background while training goes on",
         &Flags::async_save),
    spec(kObservability, "log_every", "log metrics every N steps", &Flags::log_every),
    spec(kObservability, "metrics", "write metrics as JSON lines to this file (rank 0)", &Flags::metrics),
    spec(kObservability, "tensorboard_dir", "write TensorBoard event files here (rank 0)", &Flags::tensorboard_dir),
    spec(kObservability, "timeline", "write a Chrome trace of the run to this file", &Flags::timeline),
    spec(kObservability, "profile_steps",
         "profile these steps (N or A-B) with libtorch's profiler: operators, CUDA kernels and copies",
         &Flags::profile_steps),
    spec(kObservability, "profile_out", "the profile's Chrome trace (.rankR added per rank when world > 1)",
         &Flags::profile_out),
    spec(kObservability, "count_host_syncs",
         "count the host's synchronizations with the CUDA device per step (c10's sync debug mode) and log them",
         &Flags::count_host_syncs),
    spec(kObservability, "progress", "progress bar / periodic lines on rank 0", &Flags::progress),
  };
}

const std::vector<Spec>& specs() {
  static const std::vector<Spec> all = [] {
    std::vector<Spec> out = training_specs();
    for (auto group : {layout_and_data_specs(), memory_checkpoint_and_observability_specs()}) {
      out.insert(out.end(), group.begin(), group.end());
    }
    return out;
  }();
  return all;
}

const std::vector<std::pair<Topic, const char*>>& headings() {
  static const std::vector<std::pair<Topic, const char*>> h = {
      {kTraining, "Training"}, {kRanks, "Devices and ranks"}, {kTensorParallel, "Devices and ranks"},
      {kData, "Data and evaluation"}, {kMemory, "Memory"},    {kCheckpoints, "Checkpoints and preemption"},
      {kObservability, "Observability"}};
  return h;
}

// Flags that may legitimately differ between ranks (docs/CLUSTER.md).
const std::set<std::string>& per_rank_flags() {
  static const std::set<std::string> s = {"workers", "prefetch", "progress", "log_every", "metrics",
                                          "tensorboard_dir", "timeline", "profile_steps", "profile_out", "memory_report_step",
                                          "collective_timeout_s", "host_mem_limit_gb", "offload_threads", "count_host_syncs"};
  return s;
}

struct State {
  std::mutex mutex;
  unsigned registered = 0;  // topics
  std::vector<std::pair<std::string, std::vector<std::string>>> described;  // heading -> names
  std::set<std::string> described_per_rank;
};

State& state() {
  static State s;
  return s;
}

void register_topics(unsigned topics) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const Spec& sp : specs()) {
    if ((topics & sp.topic) && !(s.registered & sp.topic)) sp.register_flag();
  }
  s.registered |= topics;
}

bool registered(const Topic topic) { return (state().registered & topic) != 0; }

std::string flag_line(const std::string& name) {
  gflags::CommandLineFlagInfo info;
  if (!gflags::GetCommandLineFlagInfo(name.c_str(), &info)) return "  --" + name + " (not defined)";
  std::string left = "--" + name + "=" + (info.type == "string" && info.default_value.empty() ? "\"\"" : info.default_value);
  std::ostringstream os;
  os << "  " << left;
  for (size_t pad = left.size(); pad < 34; ++pad) os << ' ';
  os << ' ' << info.description;
  return os.str();
}

// Flags that do nothing in the combination given: said once (on the first rank), not errors
// (scripts that sweep a matrix of layouts pass them alike).
void warn_idle_flags(const Flags& f, const OffloadChoice& offload) {
  std::vector<std::string> idle;
  const Flags d;
  if (f.sequence_parallel && f.tp == 1) idle.push_back("--sequence_parallel with --tp=1 (no sequence to split)");
  if (f.pp == 1 && (f.pp_schedule != d.pp_schedule || f.pp_chunks != d.pp_chunks)) {
    idle.push_back("--pp_schedule / --pp_chunks with --pp=1 (no pipeline)");
  }
  if (!offload.optimizer && (f.offload_stream_gradients != d.offload_stream_gradients ||
                             f.offload_reduce_to_owner != d.offload_reduce_to_owner)) {
    idle.push_back("--offload_stream_gradients / --offload_reduce_to_owner without --offload=optimizer or all");
  }
  if (f.on_nonfinite == "stop" && f.max_nonfinite_skips != d.max_nonfinite_skips) {
    idle.push_back("--max_nonfinite_skips with --on_nonfinite=stop (nothing is skipped)");
  }
  if (f.prune_amount <= 0 && f.prune_scope != d.prune_scope) idle.push_back("--prune_scope without --prune_amount");
  // Flags of the programs' own (examples/common.cc), looked up by name where they define them.
  const auto given = [](const char* name) {
    gflags::CommandLineFlagInfo info;
    return gflags::GetCommandLineFlagInfo(name, &info) && !info.is_default;
  };
  const auto value = [](const char* name) {
    std::string v;
    return gflags::GetCommandLineOption(name, &v) ? v : std::string();
  };
  if (registered(kTraining) && f.eval_every == 0 && given("eval_samples") && value("eval_only") != "true") {
    idle.push_back("--eval_samples without --eval_every or --eval_only (nothing is evaluated)");
  }
  if (given("quantize_scales") && value("quantize").empty()) idle.push_back("--quantize_scales without --quantize");
  if (idle.empty()) return;
  for (const char* rank : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const char* r = std::getenv(rank);
    if (r != nullptr && std::string(r) != "0") return;
  }
  std::string text;
  for (const std::string& i : idle) text += "\n  " + i;
  std::fprintf(stderr, "dtrain: warning: flags that have no effect in this run:%s\n", text.c_str());
}

void validate(const Flags& f) {
  if (registered(kTraining)) {
    DTRAIN_CHECK(f.steps >= 0, "--steps=", f.steps, " must be >= 0");
    DTRAIN_CHECK(f.batch_size >= 1, "--batch_size=", f.batch_size, " must be >= 1");
    DTRAIN_CHECK(std::isfinite(f.lr) && f.lr > 0, "--lr=", f.lr, " must be a positive finite number");
    DTRAIN_CHECK(f.accum_steps >= 1, "--accum_steps=", f.accum_steps, " must be >= 1");
    DTRAIN_CHECK(f.batch_size % f.accum_steps == 0, "--batch_size=", f.batch_size,
                 " is not a multiple of --accum_steps=", f.accum_steps, "; each micro-batch must have the same size");
    if (!f.optimizer.empty()) {
      OptimizerOptions o;
      o.name = f.optimizer;
      o.lr = f.lr;
      o.weight_decay = f.weight_decay;
      o.momentum = rule_traits(o.name).command_line_momentum;
      engine::validate(o);
    }
    ScheduleOptions sched;
    sched.name = f.schedule;
    sched.warmup_steps = f.warmup_steps;
    sched.total_steps = f.steps;
    engine::validate(sched);
    parse_amp(f.amp);
    parse_param_dtype(f.param_dtype);
    parse_on_nonfinite(f.on_nonfinite);
    DTRAIN_CHECK(f.max_nonfinite_skips >= 1, "--max_nonfinite_skips=", f.max_nonfinite_skips, " must be >= 1");
  }
  DTRAIN_CHECK(f.collective_timeout_s > 0, "--collective_timeout_s=", f.collective_timeout_s, " must be positive");
  DTRAIN_CHECK(f.tp >= 1, "--tp=", f.tp, " must be >= 1");
  DTRAIN_CHECK(f.pp >= 1, "--pp=", f.pp, " must be >= 1");
  DTRAIN_CHECK(f.cp >= 1, "--cp=", f.cp, " must be >= 1");
  parse_pipeline_costs(f.pp_zb_costs);  // throws naming the flag
  DTRAIN_CHECK(f.pp_zb_costs == "1,1,1" || parse_pipeline_schedule(f.pp_schedule) == PipelineSchedule::kZeroBubble,
               "--pp_zb_costs=", f.pp_zb_costs, " orders the zero-bubble schedule's lists; add --pp_schedule=zb, or "
               "drop --pp_zb_costs");
  DTRAIN_CHECK(parse_pipeline_schedule(f.pp_schedule) != PipelineSchedule::kInterleaved || f.pp_chunks >= 2,
               "--pp_schedule=interleaved needs --pp_chunks >= 2 (got ", f.pp_chunks, "); with one chunk use 1f1b");
  DTRAIN_CHECK(f.workers >= 0, "--workers=", f.workers, " must be >= 0");
  DTRAIN_CHECK(f.prefetch >= 1, "--prefetch=", f.prefetch, " must be >= 1");
  DTRAIN_CHECK(f.eval_every >= 0, "--eval_every=", f.eval_every, " must be >= 0");
  DTRAIN_CHECK(f.eval_samples >= 0, "--eval_samples=", f.eval_samples, " must be >= 0 (0: the whole held-out split)");
  const OffloadChoice offload = parse_offload(f.offload);
  parse_shard_mode(f.shard);
  DTRAIN_CHECK(f.shard_units.empty() || f.shard == "parameters" || f.plan == "auto", "--shard_units=",
               f.shard_units, " names ZeRO-3's units: it needs --shard=parameters (or --plan=auto, which may choose it)");
  engine::validate(prune_options(f));
  DTRAIN_CHECK(f.checkpoint_blocks >= -1, "--checkpoint_blocks=", f.checkpoint_blocks,
               " must be -1 (every block) or a count >= 0");
  DTRAIN_CHECK(f.checkpoint_blocks == -1 || f.checkpoint_activations, "--checkpoint_blocks=", f.checkpoint_blocks,
               " chooses which blocks --checkpoint_activations recomputes, and it is off; add "
               "--checkpoint_activations (or drop --checkpoint_blocks)");
  DTRAIN_CHECK(f.plan == "none" || f.plan == "auto", "--plan=", f.plan, " is not one of: none, auto");
  DTRAIN_CHECK(f.gpu_mem_limit_gb >= 0, "--gpu_mem_limit_gb=", f.gpu_mem_limit_gb, " must be >= 0");
  DTRAIN_CHECK(f.plan != "auto" || f.gpu_mem_limit_gb > 0, "--plan=auto needs --gpu_mem_limit_gb (the budget to fit)");
  DTRAIN_CHECK(f.host_mem_limit_gb >= 0, "--host_mem_limit_gb=", f.host_mem_limit_gb, " must be >= 0");
  parse_stream_gradients(f.offload_stream_gradients);
  DTRAIN_CHECK(f.offload_delayed_update_after >= -1, "--offload_delayed_update_after=",
               f.offload_delayed_update_after, " must be >= 0 (warm-up steps) or -1 (off)");
  DTRAIN_CHECK(f.offload_delayed_update_after < 0 || offload.optimizer || offload.layers,
               "--offload_delayed_update_after needs --offload=optimizer, --offload=all or --offload=layers");
  DTRAIN_CHECK(f.save_every >= 0, "--save_every=", f.save_every, " must be >= 0");
  DTRAIN_CHECK(f.keep_last >= 0, "--keep_last=", f.keep_last, " must be >= 0");
  DTRAIN_CHECK(!f.save_dir.empty() || (f.save_every == TrainerOptions().save_every &&
                                       f.keep_last == TrainerOptions().keep_last),
               "--save_every / --keep_last without --save_dir: nothing would be saved; add --save_dir=DIR");
  warn_idle_flags(f, offload);
  parse_resume(f.resume);
  parse_save_dir_exists(f.save_dir_exists);
  if (!f.shard_units.empty()) split_list(f.shard_units, "--shard_units");
  DTRAIN_CHECK(f.log_every >= 1, "--log_every=", f.log_every, " must be >= 1");
}

// dtrain::Error for a flag this program does not define (gflags would exit 1 with less to say):
// a standard flag of a topic the program did not ask for is named as such.
void check_known(const std::string& program, const std::vector<std::string>& args) {
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") break;
    if (a.size() < 2 || a[0] != '-' || std::isdigit(static_cast<unsigned char>(a[1])) || a[1] == '.') continue;
    std::string name = a.substr(a[1] == '-' ? 2 : 1);
    name = name.substr(0, name.find('='));
    gflags::CommandLineFlagInfo info;
    if (gflags::GetCommandLineFlagInfo(name.c_str(), &info)) continue;
    if (name.rfind("no", 0) == 0 && gflags::GetCommandLineFlagInfo(name.substr(2).c_str(), &info) &&
        info.type == "bool") {
      continue;
    }
    const std::string bare = name.rfind("no", 0) == 0 ? name.substr(2) : name;
    for (const Spec& sp : specs()) {
      if (bare != sp.name) continue;
      if (sp.topic == kTensorParallel) {
        throw Error("--" + bare + ": " + program + " has no tensor-parallel layers and cannot be split into pipeline "
                    "stages (train_gpt can; its --help lists the flags it takes)");
      }
      throw Error("--" + bare + ": " + program + " does not take dtrain's flags of this topic (its --help lists the flags it takes)");
    }
    throw Error("unknown flag --" + name + "; " + program + " --help lists the flags it takes");
  }
}

bool is_help(const std::string& a) {
  return a == "--help" || a == "-help" || a == "-h" || a == "--helpshort" || a == "-helpshort";
}

}  // namespace

const Flags& flags() { return g_values; }

void describe_flags(const std::string& heading, const std::vector<std::string>& names,
                    const std::vector<std::string>& per_rank) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.described.emplace_back(heading, names);
  s.described_per_rank.insert(per_rank.begin(), per_rank.end());
}

std::string help_text(const std::string& usage) {
  std::ostringstream os;
  os << usage << "\n";
  // A program's own flags described under a standard heading ("Training") join that section.
  std::set<std::string> standard;
  // Topics may share a heading (a program's parallelism flags join its ranks'): one section each.
  auto heading_of = [](Topic topic) {
    for (const auto& [t, h] : headings()) {
      if (t == topic) return std::string(h);
    }
    return std::string();
  };
  for (const auto& [topic, heading] : headings()) {
    if (!registered(topic) || standard.count(heading)) continue;
    standard.insert(heading);
    os << "\n" << heading << ":\n";
    for (const Spec& sp : specs()) {
      if (registered(sp.topic) && heading_of(sp.topic) == heading) os << flag_line(sp.name) << "\n";
    }
    for (const auto& [own, names] : state().described) {
      if (own != heading) continue;
      for (const std::string& name : names) os << flag_line(name) << "\n";
    }
  }
  for (const auto& [heading, names] : state().described) {
    if (standard.count(heading)) continue;
    os << "\n" << heading << ":\n";
    for (const std::string& name : names) os << flag_line(name) << "\n";
  }
  os << "\nFlags are --name=value. --helpfull lists every flag of the program, the logging library's too.\n";
  return os.str();
}

const Flags& parse(int argc, char** argv, const std::string& usage, unsigned topics,
                   const std::map<std::string, std::string>& defaults) {
  register_topics(topics);
  for (const auto& [name, value] : defaults) {
    DTRAIN_CHECK(!gflags::SetCommandLineOptionWithMode(name.c_str(), value.c_str(), gflags::SET_FLAGS_DEFAULT).empty(),
                 "cli::parse: the default '", value, "' for --", name, " is not accepted (no such flag, or a bad value)");
  }
  gflags::SetUsageMessage(usage);
  // Our own arguments array: a bare --resume of earlier versions means --resume=yes.
  static std::vector<std::string> args;
  static std::vector<char*> arg_ptrs;
  args.assign(argv, argv + argc);
  for (std::string& a : args) {
    if (is_help(a)) {
      std::fputs(help_text(usage).c_str(), stdout);
      std::fflush(stdout);
      std::exit(0);
    }
    if (a == "--resume" || a == "-resume") a = "--resume=yes";
    if (a == "--noresume" || a == "-noresume") a = "--resume=no";
  }
  const std::string program = args.empty() ? "program" : args[0].substr(args[0].rfind('/') + 1);
  check_known(program, args);
  arg_ptrs.clear();
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  arg_ptrs.push_back(nullptr);
  int n = argc;
  char** p = arg_ptrs.data();
  gflags::ParseCommandLineFlags(&n, &p, true);
  DTRAIN_CHECK(n == 1, "unexpected argument '", n > 1 ? p[1] : "", "'; flags are written --name=value");
  validate(g_values);
  return g_values;
}

void agree_on_flags(dist::Communicator& world) {
  Settings settings;
  auto add = [&](const std::string& name) {
    gflags::CommandLineFlagInfo info;
    if (gflags::GetCommandLineFlagInfo(name.c_str(), &info)) settings.emplace_back("--" + name, info.current_value);
  };
  for (const Spec& sp : specs()) {
    if (registered(sp.topic) && !per_rank_flags().count(sp.name)) add(sp.name);
  }
  for (const auto& [heading, names] : state().described) {
    for (const std::string& name : names) {
      if (!state().described_per_rank.count(name)) add(name);
    }
  }
  agree_on_settings(world, settings, "command-line flags");
}

int pipeline_chunks(const Flags& f) {
  return parse_pipeline_schedule(f.pp_schedule) == PipelineSchedule::kInterleaved ? f.pp_chunks : 1;
}

TrainerOptions trainer_options(const Flags& f, const std::string& default_optimizer, int tp_size) {
  TrainerOptions o;
  o.steps = f.steps;
  o.accum_steps = f.accum_steps;
  o.amp = parse_amp(f.amp);
  o.param_dtype = parse_param_dtype(f.param_dtype);
  o.cuda_graph = f.cuda_graph;
  o.count_host_syncs = f.count_host_syncs;
  o.optimizer.name = f.optimizer.empty() ? default_optimizer : f.optimizer;
  o.optimizer.lr = f.lr;
  o.optimizer.weight_decay = f.weight_decay;
  o.optimizer.momentum = rule_traits(o.optimizer.name).command_line_momentum;
  o.optimizer.eps = effective_eps(o.optimizer);
  o.schedule.name = f.schedule;
  o.schedule.warmup_steps = f.warmup_steps;
  o.schedule.total_steps = f.steps;
  o.clip_grad_norm = f.clip_grad_norm;
  o.on_nonfinite = parse_on_nonfinite(f.on_nonfinite);
  o.max_nonfinite_skips = f.max_nonfinite_skips;
  o.log_every = f.log_every;
  o.eval_every = f.eval_every;
  o.eval_samples = f.eval_samples;
  o.metrics_path = f.metrics;
  o.tensorboard_dir = f.tensorboard_dir;
  o.timeline_path = f.timeline;
  o.profile_steps = f.profile_steps;
  o.profile_path = f.profile_out;
  o.memory_report_step = f.memory_report_step;
  o.offload_optimizer = parse_offload(f.offload).optimizer;
  o.shard = f.shard;
  o.checkpoint_activations = f.checkpoint_activations;
  o.checkpoint_blocks = f.checkpoint_blocks;
  o.offload_layers = parse_offload(f.offload).layers;
  o.pp_blocks = f.pp_blocks;
  if (!f.shard_units.empty()) o.shard_unit_starts = split_list(f.shard_units, "--shard_units");
  o.pipeline.schedule = parse_pipeline_schedule(f.pp_schedule);
  o.pipeline.chunks = pipeline_chunks(f);
  o.pipeline.zb_costs = parse_pipeline_costs(f.pp_zb_costs);
  o.prune = prune_options(f);
  o.offload.host_mem_limit_gb = f.host_mem_limit_gb;
  o.offload.threads = f.offload_threads;
  o.offload.stream_gradients = f.offload_stream_gradients;
  o.offload.delayed_update_after = f.offload_delayed_update_after;
  o.offload.reduce_to_owner = f.offload_reduce_to_owner;
  o.save_dir = f.save_dir;
  o.save_every = f.save_every;
  o.keep_last = f.keep_last;
  o.resume = parse_resume(f.resume);
  o.save_dir_exists = parse_save_dir_exists(f.save_dir_exists);
  o.async_save = f.async_save;
  o.progress = f.progress;
  // Not yet under ZeRO-3 with pipeline stages: a stage that fails would still owe its
  // data-parallel peers its unit gathers.
  // Nor with context parallelism: a rank that fails inside ring attention leaves its group's
  // ring waiting, as a tensor-parallel group would.
  o.oom_backoff = tp_size == 1 && f.cp == 1 && !(f.shard == "parameters" && f.pp > 1);
  return o;
}

RunOptions run_options(const Flags& f) {
  RunOptions o;
  o.agree = [](dist::Communicator& world) { agree_on_flags(world); };
  o.device = f.device;
  o.backend = f.backend;
  o.collective_timeout_s = f.collective_timeout_s;
  o.tp = f.tp;
  o.pp = f.pp;
  o.cp = f.cp;
  o.pp_blocks = f.pp_blocks;
  o.sequence_parallel = f.sequence_parallel;
  o.batch_size = f.batch_size;
  o.seed = static_cast<uint64_t>(f.seed);
  o.checkpoint_activations = f.checkpoint_activations;
  o.checkpoint_blocks = f.checkpoint_blocks;
  o.offload_layers = parse_offload(f.offload).layers;
  o.plan = f.plan;
  o.plan_cluster = f.plan_cluster;
  o.gpu_mem_limit_gb = f.gpu_mem_limit_gb;
  return o;
}

std::vector<FlagInfo> registered_flags() {
  std::vector<FlagInfo> out;
  for (const Spec& sp : specs()) {
    if (registered(sp.topic)) out.push_back({sp.name, sp.topic, sp.reach});
  }
  return out;
}

LoaderOptions loader_options(const Flags& f, int64_t batch_size, c10::Device device, bool shuffle) {
  LoaderOptions o;
  o.batch_size = batch_size;
  o.shuffle = shuffle;
  o.seed = static_cast<uint64_t>(f.seed);
  o.workers = f.workers;
  o.prefetch = f.prefetch;
  o.device = device;
  return o;
}

void exit_if_preempted(const Trainer& trainer, const std::string& program, int world_rank) {
  if (!trainer.preempted()) return;
  const bool saved = !trainer.options().save_dir.empty();
  if (world_rank == 0) {
    if (saved) {
      std::printf("%s: preempted at step %lld; checkpoint saved, exiting with %d to be requeued\n", program.c_str(),
                  static_cast<long long>(trainer.current_step()), kExitRequeue);
    } else {
      std::printf("%s: preempted at step %lld; no --save_dir, nothing saved: exiting with %d, not to be requeued (a "
                  "requeued run would start over; give --save_dir to continue where it stopped)\n",
                  program.c_str(), static_cast<long long>(trainer.current_step()), kExitPreemptedUnsaved);
    }
    std::fflush(stdout);
  }
  throw Preempted{saved ? kExitRequeue : kExitPreemptedUnsaved};
}

int run_main(const std::string& program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const Preempted& p) {
    return p.code;
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what());
    return exit_code_of(e);  // 1 for a library's failure (CUDA, NCCL, MPI), 2 for a user's mistake
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what_without_backtrace());
    return kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), e.what());
    return kExitFailure;
  }
}

}  // namespace dtrain::engine::cli
