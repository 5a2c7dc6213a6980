// The command line of a dtrain program: dtrain's standard flags, registered by topic (only the
// topics a program asks for exist in it, so a program's own flags cannot collide with the rest),
// a --help that shows them grouped and short, the TrainerOptions and LoaderOptions they fill,
// and a main() wrapper with dtrain's exit codes. The examples are built on it:
//
//   int main(int argc, char** argv) {
//     return dtrain::engine::cli::run_main("my_train", [&] {
//       auto& f = dtrain::engine::cli::parse(argc, argv, "my_train [flags]: ...",
//                                            dtrain::engine::cli::kAllTopics);
//       ... world, device, communicator, mesh (f.device, f.backend, f.tp) ...
//       Trainer trainer(model, loss, mesh, device, cli::trainer_options(f, "adamw"));
//       DataLoader loader(dataset, cli::loader_options(f, f.batch_size, device));
//       trainer.fit(loader);
//       cli::exit_if_preempted(trainer);  // run_main turns it into exit code 85
//       return 0;
//     });
//   }
//
// Flags are gflags flags (--name=value); a program may DEFINE_ its own and list them with
// describe_flags() so that --help shows them and agree_on_flags() checks them across ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/train/run.h"
#include "dtrain/engine/train/trainer.h"

namespace dtrain::dist {
class Communicator;
}

namespace dtrain::engine::cli {

// Topics of the standard flags (a bit set: parse() registers those a program asks for).
enum Topic : unsigned {
  kTraining = 1u << 0,        // --steps --batch_size --lr --seed --optimizer --weight_decay --prune_*
                              // --clip_grad_norm --schedule --warmup_steps --accum_steps --amp --param_dtype
                              // --on_nonfinite --max_nonfinite_skips
  kRanks = 1u << 1,           // --device --backend --collective_timeout_s
  kTensorParallel = 1u << 2,  // model parallelism: --tp --sequence_parallel --pp --cp --pp_schedule --pp_chunks --pp_blocks
  kData = 1u << 3,            // --workers --prefetch --eval_every --eval_samples
  kMemory = 1u << 4,          // --offload --shard --shard_units --offload_* --host_mem_limit_gb --plan --gpu_mem_limit_gb
                              // --memory_report_step --checkpoint_activations
  kCheckpoints = 1u << 5,     // --save_dir --save_every --keep_last --resume --async_save
  kObservability = 1u << 6,   // --log_every --metrics --tensorboard_dir --timeline --progress
  kAllTopics = (1u << 7) - 1,
};

// The standard flags' values (after parse(); flags of topics not registered keep these
// defaults). See --help for each one's meaning. Where a flag sets an option, its default is
// that option's default, so the two cannot drift apart.
struct Flags {
  // kTraining
  int64_t steps = TrainerOptions().steps;
  int64_t batch_size = 64;  // per data-parallel rank
  double lr = 1e-3;
  int64_t seed = 0;
  std::string optimizer;  // "" : the program's default
  double weight_decay = 0;
  double clip_grad_norm = TrainerOptions().clip_grad_norm;
  std::string schedule = ScheduleOptions().name;
  int64_t warmup_steps = ScheduleOptions().warmup_steps;
  int32_t accum_steps = TrainerOptions().accum_steps;
  std::string amp = "off";
  std::string param_dtype = "float32";
  bool cuda_graph = false;
  bool count_host_syncs = false;
  std::string on_nonfinite = "stop";
  int32_t max_nonfinite_skips = TrainerOptions().max_nonfinite_skips;
  double prune_amount = PruneOptions().amount;
  std::string prune_scope = PruneOptions().scope;
  int64_t prune_at_step = PruneOptions().at_step;
  std::string prune_steps;  // "A-B": gradual pruning from step A to step B
  // kRanks
  std::string device = "auto";
  std::string backend = "auto";
  int32_t collective_timeout_s = 300;
  // kTensorParallel
  int32_t tp = 1;
  bool sequence_parallel = false;
  int32_t pp = 1;
  int32_t cp = 1;
  std::string pp_schedule = to_string(PipelineOptions().schedule);
  std::string pp_blocks;  // "a,b,...": blocks per pipeline stage ("": the even rule)
  int pp_chunks = 2;
  std::string pp_zb_costs = "1,1,1";  // --pp_schedule=zb: F,B,W costs its lists are ordered at      // --pp_schedule=interleaved: model chunks per stage (pipeline_chunks())
  // kData
  int32_t workers = LoaderOptions().workers;
  int32_t prefetch = LoaderOptions().prefetch;
  int64_t eval_every = TrainerOptions().eval_every;
  int64_t eval_samples = TrainerOptions().eval_samples;
  // kMemory
  std::string offload = "none";
  std::string shard = TrainerOptions().shard;
  std::string shard_units;  // "a.,b.,...": ZeRO-3's unit prefixes ("": the model's own)
  int32_t offload_threads = OffloadOptions().threads;
  std::string offload_stream_gradients = OffloadOptions().stream_gradients;
  bool offload_reduce_to_owner = OffloadOptions().reduce_to_owner;
  int64_t offload_delayed_update_after = OffloadOptions().delayed_update_after;
  double host_mem_limit_gb = OffloadOptions().host_mem_limit_gb;
  std::string plan = "none";
  double gpu_mem_limit_gb = 0;
  std::string plan_cluster;  // --plan=auto: the simulator's cluster file (RunOptions::plan_cluster)
  int64_t memory_report_step = TrainerOptions().memory_report_step;
  bool checkpoint_activations = false;
  int32_t checkpoint_blocks = -1;  // with checkpoint_activations: the first N blocks (-1: all)
  // kCheckpoints
  std::string save_dir;
  int64_t save_every = TrainerOptions().save_every;
  int32_t keep_last = TrainerOptions().keep_last;
  std::string resume = "no";
  std::string save_dir_exists = to_string(TrainerOptions().save_dir_exists);
  bool async_save = TrainerOptions().async_save;
  // kObservability
  int64_t log_every = TrainerOptions().log_every;
  std::string metrics;
  std::string tensorboard_dir;
  std::string timeline;
  std::string profile_steps = TrainerOptions().profile_steps;
  std::string profile_out = TrainerOptions().profile_path;
  bool progress = TrainerOptions().progress;
};

// The values (one set per process).
// The model chunks per pipeline stage the flags ask for: --pp_chunks under
// --pp_schedule=interleaved, else 1 (what TrainerOptions::pipeline.chunks gets).
int pipeline_chunks(const Flags& f);
const Flags& flags();

// The run-level flags as the library's RunOptions (train/run.h: start_run()), whose agree is
// agree_on_flags.
RunOptions run_options(const Flags& f);

// Where a standard flag's value goes (a bit set: --offload reaches two).
enum Reach : unsigned {
  kToTrainer = 1u << 0,  // trainer_options()
  kToLoader = 1u << 1,   // loader_options()
  kToRun = 1u << 2,      // run_options()
};
struct FlagInfo {
  std::string name;
  Topic topic;
  unsigned reach;
};
// The standard flags registered in this process (by parse()), in --help order.
std::vector<FlagInfo> registered_flags();

// Registers the standard flags of `topics` (once per process; a second call may only add
// topics), applies `defaults` ({"batch_size", "16"}: this program's defaults, shown by --help),
// prints the help and exits 0 for --help/-h/--helpshort (--helpfull: gflags' full list, glog's
// flags included), parses argv, and validates the standard flags (dtrain::Error naming the flag
// and the fix). A bare --resume means --resume=yes. Returns flags().
const Flags& parse(int argc, char** argv, const std::string& usage, unsigned topics = kAllTopics,
                   const std::map<std::string, std::string>& defaults = {});

// Lists flags the program DEFINEd itself under a --help heading ("Model"), and makes
// agree_on_flags() compare them across ranks (except those in `per_rank`). Call before parse().
void describe_flags(const std::string& heading, const std::vector<std::string>& names,
                    const std::vector<std::string>& per_rank = {});

// The --help text parse() prints (tests).
std::string help_text(const std::string& usage);

// Collective: every rank's standard and described flags must be equal, except the ones that
// may differ per rank (--workers, --prefetch, --progress, --log_every, --metrics,
// --tensorboard_dir, --timeline, --memory_report_step, --collective_timeout_s,
// --host_mem_limit_gb, --offload_threads); dtrain::Error on every rank naming each difference.
void agree_on_flags(dist::Communicator& world);

// TrainerOptions from the flags; default_optimizer when --optimizer is not given. tp_size: the
// mesh's tensor-parallel size (OOM back-off needs 1).
TrainerOptions trainer_options(const Flags& f, const std::string& default_optimizer, int tp_size = 1);
// LoaderOptions from the flags (workers, prefetch, seed) for the given per-rank batch and device.
// dp_rank/dp_size stay 0/1: Trainer::fit shards the loader.
LoaderOptions loader_options(const Flags& f, int64_t batch_size, c10::Device device, bool shuffle = true);

// Thrown by exit_if_preempted(); run_main() returns its code: kExitRequeue after a checkpoint,
// kExitPreemptedUnsaved without a --save_dir (a requeued run would start over).
struct Preempted {
  int code = kExitRequeue;
};
// After fit(): throws Preempted when the trainer stopped for SIGTERM/SIGUSR1 (its checkpoint
// saved, when it has a --save_dir), after printing so on rank 0 of the world.
void exit_if_preempted(const Trainer& trainer, const std::string& program, int world_rank);

// Runs body and returns its exit code, mapping failures to dtrain's exit codes (error.h):
// dtrain::Error -> "program: message" on stderr, kExitUsage (2); Preempted -> its code (85, or 143
// with nothing saved);
// other exceptions -> the message, kExitFailure (1).
int run_main(const std::string& program, const std::function<int()>& body);

}  // namespace dtrain::engine::cli

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
