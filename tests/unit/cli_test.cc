// dtrain's command line (engine/train/cli.h): every standard flag reaches the options it is
// documented to set. A flag that is registered, shown in --help and validated but read by
// nothing (as --shard_units once was by trainer_options()) trains something else than the
// user asked for without a word; this test walks the registered flags and fails for one that
// changes none of the options its Reach names, or that it has no probe for.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gflags/gflags.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/train/agreement.h"
#include "dtrain/engine/train/cli.h"

namespace dtrain::engine::cli {
namespace {

// The options a flag can reach, built from the current flag values.
struct Built {
  TrainerOptions trainer;
  LoaderOptions loader;
  RunOptions run;
};

Built build() {
  return {trainer_options(flags(), "adamw"), loader_options(flags(), flags().batch_size, c10::Device(c10::kCPU)),
          run_options(flags())};
}

template <typename T>
std::string text(const T& v) {
  return setting_text(v);
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + ";";
  return s;
}

// What the test sets and reads per flag: a valid value other than the default (with the other
// flags it needs), and the field of the options it must change.
struct Probe {
  std::string value;
  std::map<std::string, std::string> with;  // other flags the value needs to be valid
  unsigned reach;                           // which options the reader reads (Reach bits)
  std::function<std::string(const Built&)> read;
};

// Each flag: a value, the flags it needs, and where it must arrive (by topic, as --help).
std::map<std::string, Probe> training_and_layout_probes() {
  return {
    // kTraining
    {"steps", {"7", {}, kToTrainer, [](const Built& b) { return text(b.trainer.steps); }}},
    {"batch_size", {"8", {}, kToRun, [](const Built& b) { return text(b.run.batch_size); }}},
    {"lr", {"0.25", {}, kToTrainer, [](const Built& b) { return text(b.trainer.optimizer.lr); }}},
    {"seed", {"9", {}, kToLoader | kToRun, [](const Built& b) { return text(b.loader.seed) + text(b.run.seed); }}},
    {"optimizer", {"sgd", {}, kToTrainer, [](const Built& b) { return b.trainer.optimizer.name; }}},
    {"weight_decay", {"0.1", {}, kToTrainer, [](const Built& b) { return text(b.trainer.optimizer.weight_decay); }}},
    {"clip_grad_norm", {"1.5", {}, kToTrainer, [](const Built& b) { return text(b.trainer.clip_grad_norm); }}},
    {"schedule", {"cosine", {}, kToTrainer, [](const Built& b) { return b.trainer.schedule.name; }}},
    {"warmup_steps", {"3", {}, kToTrainer, [](const Built& b) { return text(b.trainer.schedule.warmup_steps); }}},
    {"accum_steps", {"2", {}, kToTrainer, [](const Built& b) { return text(b.trainer.accum_steps); }}},
    {"amp", {"bf16", {}, kToTrainer, [](const Built& b) { return to_string(b.trainer.amp); }}},
    {"param_dtype", {"bf16", {{"shard", "optimizer"}}, kToTrainer,
                     [](const Built& b) { return std::string(c10::toString(b.trainer.param_dtype)); }}},
    {"cuda_graph", {"true", {}, kToTrainer, [](const Built& b) { return text(b.trainer.cuda_graph); }}},
    {"on_nonfinite",
     {"skip", {}, kToTrainer, [](const Built& b) { return text(static_cast<int>(b.trainer.on_nonfinite)); }}},
    {"max_nonfinite_skips",
     {"3", {}, kToTrainer, [](const Built& b) { return text(b.trainer.max_nonfinite_skips); }}},
    {"prune_amount", {"0.5", {{"prune_at_step", "2"}}, kToTrainer,
                      [](const Built& b) { return text(b.trainer.prune.amount); }}},
    {"prune_scope", {"global", {}, kToTrainer, [](const Built& b) { return b.trainer.prune.scope; }}},
    {"prune_at_step", {"4", {}, kToTrainer, [](const Built& b) { return text(b.trainer.prune.at_step); }}},
    {"prune_steps", {"2-6", {}, kToTrainer,
                     [](const Built& b) { return text(b.trainer.prune.from_step) + "-" + text(b.trainer.prune.to_step); }}},
    // kRanks
    {"device", {"cpu", {}, kToRun, [](const Built& b) { return b.run.device; }}},
    {"backend", {"mpi", {}, kToRun, [](const Built& b) { return b.run.backend; }}},
    {"collective_timeout_s", {"17", {}, kToRun, [](const Built& b) { return text(b.run.collective_timeout_s); }}},
    // kTensorParallel
    {"tp", {"2", {}, kToRun, [](const Built& b) { return text(b.run.tp); }}},
    {"sequence_parallel", {"true", {}, kToRun, [](const Built& b) { return text(b.run.sequence_parallel); }}},
    {"pp", {"2", {}, kToRun, [](const Built& b) { return text(b.run.pp); }}},
    {"cp", {"2", {}, kToRun, [](const Built& b) { return text(b.run.cp); }}},
    {"pp_schedule", {"gpipe", {}, kToTrainer,
                     [](const Built& b) { return text(static_cast<int>(b.trainer.pipeline.schedule)); }}},
    {"pp_chunks", {"3", {{"pp", "2"}, {"pp_schedule", "interleaved"}}, kToTrainer,
                   [](const Built& b) { return text(b.trainer.pipeline.chunks); }}},
    {"pp_zb_costs", {"1,1.5,0.5", {{"pp", "2"}, {"pp_schedule", "zb"}}, kToTrainer,
                     [](const Built& b) { return text(b.trainer.pipeline.zb_costs.backward_input); }}},
    {"pp_blocks", {"1,2", {{"pp", "2"}}, kToTrainer | kToRun,
                   [](const Built& b) { return b.trainer.pp_blocks + "|" + b.run.pp_blocks; }}},
    // kData
    {"workers", {"5", {}, kToLoader, [](const Built& b) { return text(b.loader.workers); }}},
    {"prefetch", {"6", {}, kToLoader, [](const Built& b) { return text(b.loader.prefetch); }}},
    {"eval_every", {"11", {}, kToTrainer, [](const Built& b) { return text(b.trainer.eval_every); }}},
    {"eval_samples", {"123", {}, kToTrainer, [](const Built& b) { return text(b.trainer.eval_samples); }}},
  };
}

std::map<std::string, Probe> memory_checkpoint_and_observability_probes() {
  return {
    // kMemory
    {"offload", {"all", {}, kToTrainer | kToRun,
                 [](const Built& b) {
                   return text(b.trainer.offload_optimizer) + text(b.trainer.offload_layers) + text(b.run.offload_layers);
                 }}},
    {"shard", {"gradients", {}, kToTrainer, [](const Built& b) { return b.trainer.shard; }}},
    {"shard_units", {"wte.,blocks.0.", {{"shard", "parameters"}}, kToTrainer,
                     [](const Built& b) { return join(b.trainer.shard_unit_starts); }}},
    {"offload_threads", {"3", {}, kToTrainer, [](const Built& b) { return text(b.trainer.offload.threads); }}},
    {"offload_stream_gradients",
     {"on", {{"offload", "optimizer"}}, kToTrainer, [](const Built& b) { return b.trainer.offload.stream_gradients; }}},
    {"offload_reduce_to_owner", {"false", {{"offload", "optimizer"}}, kToTrainer,
                                 [](const Built& b) { return text(b.trainer.offload.reduce_to_owner); }}},
    {"offload_delayed_update_after", {"2", {{"offload", "optimizer"}}, kToTrainer,
                                      [](const Built& b) { return text(b.trainer.offload.delayed_update_after); }}},
    {"host_mem_limit_gb", {"3", {}, kToTrainer, [](const Built& b) { return text(b.trainer.offload.host_mem_limit_gb); }}},
    {"plan", {"auto", {{"gpu_mem_limit_gb", "4"}}, kToRun, [](const Built& b) { return b.run.plan; }}},
    {"gpu_mem_limit_gb", {"4", {}, kToRun, [](const Built& b) { return text(b.run.gpu_mem_limit_gb); }}},
    {"plan_cluster",
     {"cluster.json", {{"plan", "auto"}, {"gpu_mem_limit_gb", "4"}}, kToRun, [](const Built& b) { return b.run.plan_cluster; }}},
    {"memory_report_step", {"3", {}, kToTrainer, [](const Built& b) { return text(b.trainer.memory_report_step); }}},
    {"checkpoint_activations",
     {"true", {}, kToTrainer | kToRun,
      [](const Built& b) { return text(b.trainer.checkpoint_activations) + text(b.run.checkpoint_activations); }}},
    {"checkpoint_blocks",
     {"3", {{"checkpoint_activations", "true"}}, kToTrainer | kToRun,
      [](const Built& b) { return text(b.trainer.checkpoint_blocks) + text(b.run.checkpoint_blocks); }}},
    // kCheckpoints
    {"save_dir", {"/tmp/x", {}, kToTrainer, [](const Built& b) { return b.trainer.save_dir; }}},
    {"save_every", {"5", {}, kToTrainer, [](const Built& b) { return text(b.trainer.save_every); }}},
    {"keep_last", {"9", {}, kToTrainer, [](const Built& b) { return text(b.trainer.keep_last); }}},
    {"resume", {"auto", {}, kToTrainer, [](const Built& b) { return to_string(b.trainer.resume); }}},
    {"save_dir_exists", {"overwrite", {}, kToTrainer,
                         [](const Built& b) { return to_string(b.trainer.save_dir_exists); }}},
    {"async_save", {"false", {}, kToTrainer, [](const Built& b) { return text(b.trainer.async_save); }}},
    // kObservability
    {"log_every", {"4", {}, kToTrainer, [](const Built& b) { return text(b.trainer.log_every); }}},
    {"metrics", {"m.jsonl", {}, kToTrainer, [](const Built& b) { return b.trainer.metrics_path; }}},
    {"tensorboard_dir", {"tb", {}, kToTrainer, [](const Built& b) { return b.trainer.tensorboard_dir; }}},
    {"timeline", {"t.json", {}, kToTrainer, [](const Built& b) { return b.trainer.timeline_path; }}},
    {"profile_steps", {"2-3", {}, kToTrainer, [](const Built& b) { return b.trainer.profile_steps; }}},
    {"profile_out", {"p.json", {}, kToTrainer, [](const Built& b) { return b.trainer.profile_path; }}},
    {"progress", {"false", {}, kToTrainer, [](const Built& b) { return text(b.trainer.progress); }}},
    {"count_host_syncs", {"true", {}, kToTrainer, [](const Built& b) { return text(b.trainer.count_host_syncs); }}},
  };
}

const std::map<std::string, Probe>& probes() {
  static const std::map<std::string, Probe> p = [] {
    std::map<std::string, Probe> all = training_and_layout_probes();
    all.merge(memory_checkpoint_and_observability_probes());
    return all;
  }();
  return p;
}

const std::vector<FlagInfo>& parsed_once() {
  static const std::vector<FlagInfo> flags = [] {
    static char name[] = "cli_test";
    static char* argv[] = {name, nullptr};
    parse(1, argv, "cli_test: the standard flags", kAllTopics);
    return registered_flags();
  }();
  return flags;
}

void set(const std::string& name, const std::string& value) {
  ASSERT_FALSE(gflags::SetCommandLineOption(name.c_str(), value.c_str()).empty())
      << "--" << name << "=" << value << " was not accepted";
}

TEST(Cli, EveryRegisteredFlagReachesTheOptionsItNames) {
  const std::vector<FlagInfo>& registered = parsed_once();
  ASSERT_GT(registered.size(), 40u);
  const Built defaults = build();
  for (const FlagInfo& flag : registered) {
    SCOPED_TRACE("--" + flag.name);
    auto it = probes().find(flag.name);
    ASSERT_NE(it, probes().end()) << "no probe for --" << flag.name
                                  << " in this test: add one that reads the option it sets";
    const Probe& probe = it->second;
    EXPECT_EQ(flag.reach, probe.reach) << "cli.cc's Reach for --" << flag.name << " differs from what this test reads";
    gflags::FlagSaver restore;  // every flag back to its default after this one
    for (const auto& [other, value] : probe.with) set(other, value);
    Built before_value;
    if (!probe.with.empty()) before_value = build();
    set(flag.name, probe.value);
    Built after = build();
    const std::string was = probe.read(probe.with.empty() ? defaults : before_value), now = probe.read(after);
    EXPECT_NE(was, now) << "--" << flag.name << "=" << probe.value << " changed nothing the option reader sees ("
                        << now << "): the flag is accepted and ignored";
  }
  // And no probe for a flag that no longer exists (the table follows the registry).
  for (const auto& [name, probe] : probes()) {
    bool found = false;
    for (const FlagInfo& flag : registered) found = found || flag.name == name;
    EXPECT_TRUE(found) << "probe for --" << name << ", which is not a registered flag";
  }
}

TEST(Cli, ShardUnitsReachTrainerOptionsAsTheirPrefixes) {
  parsed_once();
  gflags::FlagSaver restore;
  set("shard", "parameters");
  set("shard_units", "wte.,blocks.0.,blocks.1.,ln_f.");
  const TrainerOptions o = trainer_options(flags(), "adamw");
  EXPECT_EQ(o.shard_unit_starts, (std::vector<std::string>{"wte.", "blocks.0.", "blocks.1.", "ln_f."}));
  set("shard_units", "wte.,,ln_f.");
  try {
    trainer_options(flags(), "adamw");
    ADD_FAILURE() << "an empty unit prefix was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--shard_units=wte.,,ln_f.: an empty item"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtrain::engine::cli
