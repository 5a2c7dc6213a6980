// dtrain-plan: how much memory an example model needs and the fastest way to fit it.
//
// Builds the model (--model=seq2seq|gpt|mlp with the usual shape flags) on the device, runs
// the activation probe (a real forward + backward of a small synthetic batch per technique),
// prints the memory estimate of the technique the flags select, and the plan for the budget:
// the flags to add, why, and one JSON line for scripts. --verify_steps=N then trains N steps
// of the flags' technique with the engine's Trainer on a synthetic batch and prints the
// measured allocated peak against the estimate.
//   dtrain-plan --model=seq2seq --gpu_mem_limit_gb=20
//   dtrain-plan --model=gpt --batch_size=16 --gpu_mem_limit_gb=40 --allow_amp_change
// With --pp (gpt; under mpirun with the run's ranks) each rank probes its own stage, the plan
// is the fastest that fits every stage, and --verify_steps trains the pipeline:
//   mpirun -np 4 dtrain-plan --model=gpt --pp=4 --gpu_mem_limit_gb=40 --verify_steps=3
// --simulate predicts a layout's step time and memory on a cluster without running it, and
// --calibrate measures this machine for it (plan_simulate.cc).
#include <c10/core/CachingDeviceAllocator.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <nlohmann/json.hpp>

#include "common.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/memory/planner.h"
#include "dtrain/engine/optim/sharded.h"
#include "model_factory.h"
#include "plan_simulate.h"

DEFINE_string(model, "seq2seq", "the example model to plan for: seq2seq, gpt, llama, mlp or cnn");
DEFINE_bool(allow_amp_change, false, "the plan may switch --amp to bf16 (changes the numerics)");
DEFINE_string(allow_offload, "none", "offload the plan may use: none, optimizer, layers or all");
DEFINE_bool(allow_shard, false, "the plan may add --shard=optimizer or --shard=gradients (ZeRO-1/2; dp > 1)");
DEFINE_int64(probe_rows, 2, "activation probe micro-batch sizes: this many rows and twice as many");
DEFINE_int64(cuda_context_mb, -1,
             "CUDA context outside the allocator in MiB (-1: 500 on CUDA, 0 on the CPU)");
DEFINE_int64(verify_steps, 0,
             "train this many steps of the flags' technique and compare the peak (0: off)");

DECLARE_string(calibrate);
DECLARE_string(measure);

using namespace dtrain;

namespace {

constexpr double kMiBf = 1024.0 * 1024.0;

// The model's inputs plus this program's budgets and permissions.
engine::PlanInputs budgeted_inputs(const examples::Run& run, examples::ExampleModel& m,
                                   const engine::TrainerOptions& options) {
  engine::PlanInputs in = examples::plan_inputs(run, m, options);
  in.allow_amp_change = FLAGS_allow_amp_change;
  in.can_offload_optimizer = FLAGS_allow_offload == "optimizer" || FLAGS_allow_offload == "all";
  in.can_offload_layers = FLAGS_allow_offload == "layers" || FLAGS_allow_offload == "all";
  in.can_shard = FLAGS_allow_shard;
  if (engine::cli::flags().gpu_mem_limit_gb > 0) {
    in.gpu_budget_bytes = static_cast<int64_t>(engine::cli::flags().gpu_mem_limit_gb * 1024 * 1024 * 1024);
  } else if (run.device.is_cuda()) {
    in.gpu_budget_bytes = static_cast<int64_t>(
        c10::getDeviceAllocator(c10::kCUDA)->getMemoryInfo(run.device.index()).second);
  }
  // --host_mem_limit_gb, else this process's share of the node's MemAvailable.
  in.host_budget_bytes = engine::host_budget_bytes(engine::cli::flags().host_mem_limit_gb, run.world.local_size);
  if (FLAGS_cuda_context_mb >= 0)
    in.cuda_context_bytes = FLAGS_cuda_context_mb * (int64_t{1} << 20);
  in.step_time = examples::simulator_step_time(run, m.name);  // --plan_cluster
  return in;
}

// Trains --verify_steps steps of the flags' technique on one synthetic batch and compares
// the allocator's peak (above what was allocated before the model) with the estimate; with
// --pp, each stage's (the first lines and the JSON's "stages"; the other figures are stage 0's).
// With --gpu_mem_limit_gb on a GPU the caching allocator is capped first (apply_memory_limit
// with the budget less the CUDA context), so a plan that does not really fit fails here.
void verify(const examples::Run& run, examples::ExampleModel& m, const engine::PlanInputs& in,
            const engine::MemoryEstimate& e, int64_t baseline_bytes) {
  engine::TrainerOptions o = examples::trainer_options(run, m.default_optimizer);
  o.steps = FLAGS_verify_steps;
  o.progress = false;
  o.oom_backoff = false;
  o.metrics_path.clear();
  o.tensorboard_dir.clear();
  o.timeline_path.clear();
  o.save_dir.clear();
  o.memory_report_step = 0;
  examples::checkpoint_as_flags(m);
  engine::release_cached_memory(run.device);
  bool capped = false;
  if (engine::cli::flags().gpu_mem_limit_gb > 0) {
    capped = engine::apply_memory_limit(
        run.device, std::max<int64_t>(1, in.gpu_budget_bytes - in.cuda_context_bytes));
  }
  // A model with a spec (gpt): the trainer applies the stage, the units and checkpointing itself.
  std::unique_ptr<engine::Trainer> made = examples::make_trainer(run, m, o);
  engine::Trainer& trainer = *made;
  engine::Batch batch = m.synthetic_batch(engine::cli::flags().batch_size);
  engine::reset_peak_memory(run.device);
  for (int64_t s = 0; s < FLAGS_verify_steps; ++s) trainer.step(batch);
  // On the CPU the allocator also counts an offloaded optimizer's host memory, which a GPU run
  // holds outside the device: the comparison is with the device's part. On a GPU the host
  // side is the report's host rows (optimizer offload's pool, layer offload's parameters,
  // gradients and the optimizer state beside them).
  const engine::MemoryReport report = trainer.memory_report();
  const double host_offload = run.device.is_cpu() ? report.host_offload_mb * kMiBf : 0.0;
  const double host_measured =
      run.device.is_cpu() ? host_offload : (report.host_total_mb() - report.host_staging_mb) * kMiBf;
  const double measured =
      engine::memory_stats(run.device).peak_mb * kMiBf - static_cast<double>(baseline_bytes) - host_offload;
  const double predicted = static_cast<double>(e.gpu.allocated_peak());
  const double error = (predicted - measured) / measured;
  // With --pp each stage's own figures (from the first data- and tensor-parallel rank of each).
  const int P = run.mesh->pp_size();
  const std::vector<std::vector<double>> stages = examples::per_stage(run, {measured, predicted});
  if (run.world.rank != 0) return;
  nlohmann::json per_stage = nlohmann::json::array();
  for (int s = 0; s < P && P > 1; ++s) {
    const double ms = stages[s][0], ps = stages[s][1];
    std::printf("verify: stage %d: measured allocated peak %.1f MiB, estimated %.1f MiB (%+.1f%%)\n", s,
                ms / kMiBf, ps / kMiBf, 100 * (ps - ms) / ms);
    per_stage.push_back({{"measured_peak_bytes", static_cast<int64_t>(ms)},
                         {"estimated_peak_bytes", static_cast<int64_t>(ps)},
                         {"relative_error", (ps - ms) / ms}});
  }
  std::printf(
      "verify: %lld steps of %s%s: measured allocated peak %.1f MiB, estimated %.1f MiB "
      "(%+.1f%%)\n",
      static_cast<long long>(FLAGS_verify_steps),
      e.technique.flags().empty() ? "the plain step" : e.technique.flags().c_str(),
      capped ? " under the GPU cap" : "", measured / kMiBf, predicted / kMiBf, 100 * error);
  // The host: what offload keeps there (master weights, state, gradient buffers, staging;
  // layer offload's weights and gradients).
  const double host_predicted = static_cast<double>(e.host.total());
  if (host_measured > 0 || host_predicted > 0) {
    std::printf("verify: host memory of offload %.1f MiB, estimated %.1f MiB (%+.1f%%)\n", host_measured / kMiBf,
                host_predicted / kMiBf, host_measured > 0 ? 100 * (host_predicted - host_measured) / host_measured : 0.0);
  }
  nlohmann::json j;
  j["verify_steps"] = FLAGS_verify_steps;
  j["measured_host_bytes"] = static_cast<int64_t>(host_measured);
  j["estimated_host_bytes"] = e.host.total();
  if (host_measured > 0) j["host_relative_error"] = (host_predicted - host_measured) / host_measured;
  j["flags"] = e.technique.flags();
  j["measured_peak_bytes"] = static_cast<int64_t>(measured);
  j["estimated_peak_bytes"] = e.gpu.allocated_peak();
  j["relative_error"] = error;
  j["capped"] = capped;
  if (P > 1) j["stages"] = per_stage;
  std::printf("%s\n", j.dump().c_str());
}

int plan_main(int argc, char** argv) {
  const std::string model_name = examples::flag_from_argv(argc, argv, "model", "seq2seq");
  engine::cli::describe_flags("Plan", {"model", "allow_amp_change", "allow_offload", "allow_shard", "probe_rows",
                                      "cuda_context_mb", "verify_steps"});
  engine::cli::describe_flags("Simulate", examples::simulate_flag_names());
  if (examples::simulate_requested(argc, argv)) return examples::simulate_main(argc, argv, model_name);
  examples::Run run = examples::init_run(argc, argv,
                                         "dtrain-plan --model=seq2seq|gpt|mlp|cnn [shape flags] "
                                         "[--gpu_mem_limit_gb=X]: memory estimate and plan",
                                         examples::model_flag_defaults(model_name),
                                         examples::model_checks(model_name), examples::model_flag_names(model_name));
  DTRAIN_CHECK(FLAGS_allow_offload == "none" || FLAGS_allow_offload == "optimizer" ||
                   FLAGS_allow_offload == "layers" || FLAGS_allow_offload == "all",
               "--allow_offload=", FLAGS_allow_offload,
               " is not one of: none, optimizer, layers, all");
  DTRAIN_CHECK(FLAGS_probe_rows >= 1, "--probe_rows=", FLAGS_probe_rows, " must be >= 1");
  DTRAIN_CHECK(std::isfinite(engine::cli::flags().gpu_mem_limit_gb) && engine::cli::flags().gpu_mem_limit_gb >= 0,
               "--gpu_mem_limit_gb=", engine::cli::flags().gpu_mem_limit_gb,
               " must be >= 0 (0: the whole device)");
  DTRAIN_CHECK(FLAGS_verify_steps >= 0, "--verify_steps=", FLAGS_verify_steps, " must be >= 0");
  const bool rank0 = run.world.rank == 0;
  const int64_t baseline = std::llround(engine::memory_stats(run.device).allocated_mb * kMiBf);
  examples::ExampleModel m = examples::build_example_model(model_name, run);
  const engine::TrainerOptions options = examples::trainer_options(run, m.default_optimizer);
  if (!FLAGS_calibrate.empty()) {
    examples::calibrate(run, m, options, FLAGS_calibrate);
    return 0;
  }
  if (!FLAGS_measure.empty()) {
    examples::measure(run, m, FLAGS_measure);
    return 0;
  }
  // The data the program would hold: on a CPU run it is in the device's memory during every step,
  // and --plan=auto counts it (a user audit: without it dtrain-plan chose the plain step that
  // --plan=auto, 2.3 MiB fuller, refused).
  std::optional<examples::TokenData> tokens;
  std::optional<examples::ClassificationData> digits;
  if (run.device.is_cpu()) {
    if (model_name == "gpt" || model_name == "llama") tokens = examples::token_data(run, FLAGS_seq_len, true);
    if (model_name == "seq2seq") tokens = examples::token_data(run, 2 * FLAGS_seq_len, false);
    if (model_name == "mlp" || model_name == "cnn") digits = examples::classification_data();
  }
  engine::PlanInputs in = budgeted_inputs(run, m, options);
  in.buffer_bytes += examples::held_besides_model(run, m);

  std::vector<engine::AmpMode> amps = {in.amp};
  if (FLAGS_allow_amp_change && in.amp != engine::AmpMode::kBf16)
    amps.push_back(engine::AmpMode::kBf16);
  if (FLAGS_allow_amp_change && in.amp != engine::AmpMode::kOff)
    amps.push_back(engine::AmpMode::kOff);
  const engine::ActivationProfile profile =
      examples::probe_example_model(run, m, amps, FLAGS_probe_rows);

  engine::Technique current;
  current.checkpoint = engine::cli::flags().checkpoint_activations;
  current.checkpoint_blocks = engine::cli::flags().checkpoint_blocks;
  current.accum_steps = engine::cli::flags().accum_steps;
  current.amp = in.amp;
  current.offload_optimizer = engine::cli::flags().offload == "optimizer" || engine::cli::flags().offload == "all";
  current.offload_layers = engine::cli::flags().offload == "layers" || engine::cli::flags().offload == "all";
  current.shard = static_cast<int>(engine::parse_shard_mode(engine::cli::flags().shard));
  const engine::MemoryEstimate now = engine::estimate(in, profile, current);
  if (rank0) {
    std::printf(
        "dtrain-plan: %s on %s, %.2fM parameters (%lld sharded over tp %d), %s %d, batch %lld, "
        "optimizer %s, amp %s%s\n",
        model_name.c_str(), run.device.str().c_str(), in.parameters / 1e6,
        static_cast<long long>(in.sharded_parameters), in.tp, run.mesh->cp_size() > 1 ? "replicas (dp x cp)" : "dp", in.dp,
        static_cast<long long>(in.batch_size), in.optimizer.c_str(), engine::to_string(in.amp),
        in.pp > 1 ? (" (pipeline stage 0 of " + std::to_string(in.pp) + ": the figures below are its own)").c_str() : "");
    std::printf("activation probe:\n%s", profile.to_string().c_str());
    std::printf("%s", now.to_string().c_str());
    auto budget = [](int64_t bytes) {
      return bytes == 0 ? std::string("no limit")
                        : std::to_string(bytes / (1024 * kMiBf)).substr(0, 6) + " GiB";
    };
    std::printf("budget: GPU %s, host %s\n", budget(in.gpu_budget_bytes).c_str(),
                budget(in.host_budget_bytes).c_str());
    std::fflush(stdout);
  }
  // One plan for every rank (with --pp, each stage probed its own layers); dtrain::Error when
  // nothing fits.
  engine::Plan plan = engine::choose_plan(in, profile, engine::agreement_over(*run.comm));
  const std::string stages = examples::stage_estimates(run, plan.estimate);
  if (rank0) {
    std::printf("plan: %s\n%s", plan.flags().empty() ? "the plain step (no flags to add)"
                                                     : ("add " + plan.flags()).c_str(), stages.c_str());
    std::printf("reason: %s\n", plan.reason.c_str());
    nlohmann::json j = nlohmann::json::parse(plan.to_json());
    j["model"] = model_name;
    j["current_flags_gpu_bytes"] = now.gpu.total();
    j["current_flags_in_flight"] = now.in_flight;
    j["current_flags_fit"] =
        (in.gpu_budget_bytes == 0 || now.gpu.total() <= in.gpu_budget_bytes) &&
        (in.host_budget_bytes == 0 || now.host.total() <= in.host_budget_bytes);
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  if (FLAGS_verify_steps > 0) verify(run, m, in, now, baseline);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::guarded_main("dtrain-plan", [&] { return plan_main(argc, argv); });
}
