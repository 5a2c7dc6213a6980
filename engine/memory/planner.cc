// estimate() and choose_plan(): closed forms for the static memory, the probe's line for the
// activations, a cost model to rank what fits.
#include "dtrain/engine/memory/planner.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <cmath>
#include <limits>
#include <cstdio>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/offload/pinned_pool.h"
#include "dtrain/offload/update_rule.h"
#include "recompute_rule.h"

namespace dtrain::engine {
namespace {

constexpr double kGiBf = 1024.0 * kBytesPerMiB;
constexpr double kCheckpointComputeFactor = 4.0 / 3.0;  // one more forward of three passes
constexpr double kDefaultSecondsPerRow = 1e-3;
constexpr double kDefaultMicroBatchSeconds = 1e-3;
// Pinned staging tiles of the CPU optimizer's copies (two tiles of 4 Mi fp32 elements).
constexpr int64_t kOffloadStagingBytes = int64_t{32} << 20;

// GiB from 1 GiB up, MiB below.
std::string size_text(int64_t bytes) {
  char buf[32];
  if (bytes >= static_cast<int64_t>(kGiBf)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / kGiBf);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / kBytesPerMiB);
  }
  return buf;
}

int64_t ceil_bytes(double x) { return x <= 0 ? 0 : static_cast<int64_t>(std::ceil(x)); }

int state_tensors(const PlanInputs& in) {
  offload::UpdateRuleOptions rule;
  rule.name = in.optimizer;
  rule.amsgrad = in.amsgrad;
  rule.momentum = in.momentum;
  return static_cast<int>(offload::moment_names(rule).size());
}

// Parameters this rank holds: the replicated ones and its share of the sharded ones.
int64_t local_parameters(const PlanInputs& in) {
  return in.parameters - in.sharded_parameters + (in.sharded_parameters + in.tp - 1) / in.tp;
}

// The part of the local parameters inside the blocks layer offload streams (sharded in the
// proportion of the whole model).
int64_t local_layer_parameters(const PlanInputs& in) {
  if (in.parameters == 0) return 0;
  return static_cast<int64_t>(static_cast<double>(in.layer_parameters) * local_parameters(in) /
                              static_cast<double>(in.parameters));
}

bool interleaved(const PlanInputs& in) { return in.pp > 1 && in.pp_schedule == PipelineSchedule::kInterleaved; }

std::vector<int> accum_candidates(const PlanInputs& in) {
  if (!in.accum_candidates.empty()) return in.accum_candidates;
  std::vector<int> out;
  for (int64_t a = 1; a <= in.batch_size; a *= 2) {
    if (in.batch_size % a == 0 && (!interleaved(in) || a % in.pp == 0)) out.push_back(static_cast<int>(a));
  }
  // Interleaved: the micro-batches go P at a time; powers of two miss P 3, 5, ...
  for (int64_t a = in.pp; interleaved(in) && out.empty() && a <= in.batch_size; a += in.pp) {
    if (in.batch_size % a == 0) out.push_back(static_cast<int>(a));
  }
  return out;
}

// Checkpointing's candidates: 0 (off), -1 (every block) and, with L >= 2 uniform blocks (the
// model's, or with pipeline stages the fewest a stage holds; not interleaved), the first k for k
// at the eighths of L (every k from 1 to L - 1 when L <= 8). The same list on every rank, so a
// PlanAgreement compares like with like.
std::vector<int> checkpoint_candidates(const PlanInputs& in) {
  std::vector<int> out = {0, -1};
  const int L = in.pp > 1 ? in.fewest_stage_layers : in.layers;
  if (!in.can_checkpoint || !in.uniform_blocks || L < 2 || interleaved(in)) return out;
  for (int j = 1; j <= 7; ++j) {
    const int k = std::clamp((j * L + 4) / 8, 1, L - 1);
    if (out.back() != k) out.push_back(k);
  }
  return out;
}

// Compute seconds per row and per micro-batch for an AMP mode: PlanInputs' figures where
// given, else the line through the probe's two timings, else the defaults.
std::pair<double, double> compute_rates(const PlanInputs& in, const ActivationProfile& profile,
                                        AmpMode amp) {
  double per_row = kDefaultSecondsPerRow, per_micro = kDefaultMicroBatchSeconds;
  double factor = 1.0;
  const ActivationFit* fit = profile.find(false, amp);
  if (!fit) {
    fit = profile.find(true, amp);
    factor = 1.0 / kCheckpointComputeFactor;
  }
  if (fit && fit->seconds[0] > 0 && fit->seconds[1] > 0 && fit->rows[1] > fit->rows[0]) {
    double slope =
        (fit->seconds[1] - fit->seconds[0]) / static_cast<double>(fit->rows[1] - fit->rows[0]);
    double intercept = fit->seconds[0] - slope * static_cast<double>(fit->rows[0]);
    if (slope <= 0) {  // timing noise at tiny sizes: count all of it per row
      slope = fit->seconds[1] / static_cast<double>(fit->rows[1]);
      intercept = 0;
    }
    per_row = slope * factor;
    per_micro = std::max(0.0, intercept) * factor;
  }
  if (in.compute_seconds_per_row > 0) per_row = in.compute_seconds_per_row;
  if (in.micro_batch_overhead_seconds > 0) per_micro = in.micro_batch_overhead_seconds;
  return {per_row, per_micro};
}

// The share of the blocks recomputed in backward (recompute_rule.h) of PlanInputs::layers (a model
// that names no blocks: all or none).
double recomputed_share(const PlanInputs& in, const Technique& t) {
  const double all = in.layers > 0 ? static_cast<double>(in.layers) : 1.0;
  return recompute::recomputed_blocks(all, t.checkpoint, t.checkpoint_blocks, t.offload_layers) / all;
}

double cost_seconds(const PlanInputs& in, const ActivationProfile& profile, const Technique& t) {
  auto [per_row, per_micro] = compute_rates(in, profile, t.amp);
  const double recompute = 1.0 + (kCheckpointComputeFactor - 1.0) * recomputed_share(in, t);
  double seconds = in.batch_size * per_row * recompute;
  seconds += t.accum_steps * per_micro;
  // A pipeline's step: the schedule's simulated step over its work (1F1B: accum_steps + pp - 1
  // micro-batch times), the bubble among them.
  if (in.pp > 1) {
    const int v = interleaved(in) ? in.pp_chunks : 1;
    seconds *= simulate_pipeline(in.pp_schedule, in.pp, t.accum_steps, {}, v).step / (3.0 * t.accum_steps * v);
  }
  const double local = static_cast<double>(local_parameters(in));
  if (t.offload_optimizer) {
    const double cpu_bytes =
        (8.0 * (1 + state_tensors(in)) + 4 + in.bytes_per_parameter) * local / in.dp;
    seconds += cpu_bytes / in.host_bytes_per_second;
    seconds +=
        2.0 * local * in.bytes_per_parameter / in.pcie_bytes_per_second;  // grads down, weights up
  }
  if (t.shard > 0 && t.shard < 3 && in.dp > 1) {
    // Reduction to owners (1 x) + all-gather ((dp - 1) / dp x) against the all-reduce's
    // 2 (dp - 1) / dp x: weights / dp more bytes per step, not overlapped with compute.
    seconds += local * in.bytes_per_parameter / in.dp / in.network_bytes_per_second;
  }
  if (t.shard == 3 && in.dp > 1) {
    // ZeRO-3: every micro-batch all-gathers the weights twice (forward, backward) and the step
    // reduce-scatters them once, (dp - 1) / dp of the bytes each, against the all-reduce's
    // 2 (dp - 1) / dp: counted whole (the prefetch hides part of it behind compute).
    const double weights = local * in.bytes_per_parameter;
    const double share = static_cast<double>(in.dp - 1) / in.dp;
    seconds += (2.0 * t.accum_steps - 1) * share * weights / in.network_bytes_per_second;
  }
  if (t.offload_layers) {
    const double layer_bytes =
        static_cast<double>(local_layer_parameters(in)) * in.bytes_per_parameter;
    seconds += t.accum_steps * 3.0 * layer_bytes / in.pcie_bytes_per_second;
  }
  return seconds;
}

int techniques_used(const Technique& t, AmpMode asked) {
  return int{t.checkpoint} + int{t.accum_steps > 1} + int{t.amp != asked} +
         int{t.offload_optimizer} + int{t.offload_layers} + int{t.shard > 0};
}

// How far a technique departs from the plain step, compared in this order: the techniques it
// uses, its micro-batches, the share of blocks it recomputes, its ZeRO stage, what it offloads.
std::tuple<int, int, double, int, int> simplicity(const PlanInputs& in, const Technique& t) {
  return {techniques_used(t, in.amp), t.accum_steps, recomputed_share(in, t), t.shard,
          int{t.offload_optimizer} + int{t.offload_layers}};
}

// A candidate technique with the figures the choice follows: this rank's own, or (with a
// PlanAgreement) the maximum over the ranks that apply one plan.
struct Candidate {
  MemoryEstimate estimate;  // this rank's
  double seconds = 0;
  int64_t gpu = 0, host = 0;  // totals
};

bool fits(const PlanInputs& in, const Candidate& c) {
  return (in.gpu_budget_bytes == 0 || c.gpu <= in.gpu_budget_bytes) &&
         (in.host_budget_bytes == 0 || c.host <= in.host_budget_bytes);
}

std::string component_summary(const MemoryComponents& c) {
  std::ostringstream os;
  os << "parameters " << size_text(c.parameters) << ", gradients " << size_text(c.gradients)
     << ", optimizer state " << size_text(c.optimizer_state) << ", activations "
     << size_text(c.activations) << ", old gradient buckets " << size_text(c.stale_gradients)
     << ", other " << size_text(c.other) << ", workspace " << size_text(c.workspace)
     << ", CUDA context " << size_text(c.cuda_context);
  return os.str();
}

std::string budget_text(int64_t bytes) { return bytes == 0 ? "no limit" : size_text(bytes); }

std::string nothing_fits_message(const PlanInputs& in, const std::vector<Candidate>& all, bool agreed) {
  const Candidate* least = &all.front();
  for (const Candidate& c : all) {
    if (c.gpu < least->gpu || (c.gpu == least->gpu && c.host < least->host)) least = &c;
  }
  const MemoryEstimate* smallest = &least->estimate;
  const bool gpu_short = in.gpu_budget_bytes > 0 && least->gpu > in.gpu_budget_bytes;
  std::ostringstream os;
  os << "no combination of techniques fits the GPU budget of " << budget_text(in.gpu_budget_bytes)
     << " (host budget " << budget_text(in.host_budget_bytes) << ") among " << all.size()
     << " candidates" << (agreed ? " on every rank" : "") << ": the smallest GPU estimate is "
     << size_text(least->gpu) << " on the GPU and " << size_text(least->host) << " on the host"
     << (agreed ? " (the most any rank needs)" : "") << ", with "
     << (smallest->technique.flags().empty() ? "the plain step" : smallest->technique.flags())
     << " (micro-batch of " << smallest->micro_batch_rows << " rows";
  if (smallest->in_flight > 1) os << ", " << smallest->in_flight << " in flight on pipeline stage " << in.stage;
  os << "; " << (agreed ? "this rank's " : "") << component_summary(smallest->gpu) << "). To fit: ";
  std::vector<std::string> fixes;
  if (gpu_short) {
    fixes.push_back("raise --gpu_mem_limit_gb to at least " + size_text(least->gpu));
    fixes.push_back("lower --batch_size (activations scale with the micro-batch)");
    if (!in.can_checkpoint) fixes.push_back("allow --checkpoint_activations");
    if (in.amp == AmpMode::kOff && !in.allow_amp_change)
      fixes.push_back("allow mixed precision (--amp=bf16)");
    if (!in.can_offload_optimizer) fixes.push_back("allow --offload=optimizer");
    if (!in.can_offload_layers) fixes.push_back("allow --offload=layers");
    if (!in.can_shard && in.dp > 1) fixes.push_back("allow --shard (ZeRO-1/2 over the " + std::to_string(in.dp) + " data-parallel ranks)");
    fixes.push_back(in.pp > 1 ? "split the model over more GPUs (--tp, or more --pp stages)"
                              : "split the model over more GPUs (--tp, --pp)");
    if (in.pp > 1 && in.pp_schedule != PipelineSchedule::k1F1B) {
      fixes.push_back("use --pp_schedule=1f1b (it holds fewer micro-batches)");
    }
  } else {
    // The host budget is --host_mem_limit_gb or this process's share of the node's
    // MemAvailable (host_budget_bytes()): name what it needs and what there is.
    fixes.push_back("it needs " + size_text(least->host) + " of host memory and has " +
                    size_text(in.host_budget_bytes) + " (--host_mem_limit_gb, or this process's share of "
                    "the node's MemAvailable): raise --host_mem_limit_gb to at least " + size_text(least->host) +
                    " where the machine has it, run fewer processes per node");
    fixes.push_back("spread the offloaded optimizer state over more data-parallel ranks");
  }
  for (size_t i = 0; i < fixes.size(); ++i) os << (i ? "; " : "") << fixes[i];
  return os.str();
}

std::string plan_reason(const PlanInputs& in, const std::vector<Candidate>& all,
                        const std::vector<const Candidate*>& fitting, bool agreed) {
  const Candidate& best = *fitting.front();
  const std::string name =
      best.estimate.technique.flags().empty() ? "the plain step" : best.estimate.technique.flags();
  std::ostringstream os;
  os << "chose " << name << ": " << size_text(best.gpu) << " of the GPU budget "
     << budget_text(in.gpu_budget_bytes);
  if (best.host > 0) os << " and " << size_text(best.host) << " on the host";
  if (agreed) os << " (the most any rank needs)";
  os << ", ~" << std::fixed << std::setprecision(1) << best.seconds * 1e3 << " ms/step by the "
     << (in.step_time ? "step-time model" : "cost model");
  if (in.pp > 1) {
    os << " (" << best.estimate.technique.accum_steps << " micro-batches through " << in.pp
       << " stages, " << best.estimate.in_flight << " in flight on stage " << in.stage << ")";
  }
  os << "; " << fitting.size() << " of " << all.size() << " candidates fit";
  // The plain step (first candidate: no technique) and whether it fits.
  for (const Candidate& c : all) {
    if (techniques_used(c.estimate.technique, in.amp) == 0) {
      os << "; the plain step needs " << size_text(c.gpu) << (fits(in, c) ? " (fits)" : " (does not fit)");
      if (fits(in, c) && &c != &best && c.seconds > 0) {
        os << ", expected " << std::setprecision(1) << 100 * (c.seconds - best.seconds) / c.seconds
           << "% faster than it (~" << c.seconds * 1e3 << " ms/step)";
      }
      break;
    }
  }
  const Candidate* fastest = *std::min_element(
      fitting.begin(), fitting.end(), [](const Candidate* a, const Candidate* b) { return a->seconds < b->seconds; });
  if (fastest->seconds < best.seconds) {
    os << "; the fastest, "
       << (fastest->estimate.technique.flags().empty() ? "the plain step" : fastest->estimate.technique.flags())
       << " at ~" << fastest->seconds * 1e3 << " ms/step, is within " << std::setprecision(0)
       << 100 * in.time_tolerance << "% and departs further from the plain step" << std::setprecision(1);
  }
  if (fitting.size() > 1) {
    const Candidate& next = *fitting[1];
    os << "; next best: "
       << (next.estimate.technique.flags().empty() ? "the plain step" : next.estimate.technique.flags())
       << " at ~" << next.seconds * 1e3 << " ms/step";
  }
  return os.str();
}

}  // namespace

std::string Technique::flags() const {
  std::vector<std::string> parts;
  if (checkpoint) parts.push_back("--checkpoint_activations");
  if (checkpoint && checkpoint_blocks >= 0) parts.push_back("--checkpoint_blocks=" + std::to_string(checkpoint_blocks));
  if (accum_steps > 1) parts.push_back("--accum_steps=" + std::to_string(accum_steps));
  if (amp != AmpMode::kOff) parts.push_back(std::string("--amp=") + engine::to_string(amp));
  if (offload_optimizer && offload_layers) {
    parts.push_back("--offload=all");
  } else if (offload_optimizer) {
    parts.push_back("--offload=optimizer");
  } else if (offload_layers) {
    parts.push_back("--offload=layers");
  }
  if (shard == 1) parts.push_back("--shard=optimizer");
  if (shard == 2) parts.push_back("--shard=gradients");
  if (shard == 3) parts.push_back("--shard=parameters");
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : " ") + p;
  return out;
}

std::string Technique::to_string() const {
  std::ostringstream os;
  os << "checkpoint " << (!checkpoint ? "off" : checkpoint_blocks < 0 ? "on" : "on (the first " +
                                               std::to_string(checkpoint_blocks) + " blocks)")
     << ", accum " << accum_steps << ", amp "
     << engine::to_string(amp) << ", offload "
     << (offload_optimizer && offload_layers ? "all"
         : offload_optimizer                 ? "optimizer"
         : offload_layers                    ? "layers"
                                             : "none")
     << ", shard " << (shard == 1 ? "optimizer" : shard == 2 ? "gradients" : shard == 3 ? "parameters" : "none");
  return os.str();
}

void validate(const PlanInputs& in) {
  DTRAIN_CHECK(in.parameters >= 0, "PlanInputs.parameters must be >= 0, got ", in.parameters);
  DTRAIN_CHECK(in.sharded_parameters >= 0 && in.sharded_parameters <= in.parameters,
               "PlanInputs.sharded_parameters=", in.sharded_parameters,
               " must be in [0, parameters=", in.parameters, "]");
  DTRAIN_CHECK(in.layer_parameters >= 0 && in.layer_parameters <= in.parameters,
               "PlanInputs.layer_parameters=", in.layer_parameters,
               " must be in [0, parameters=", in.parameters, "]");
  DTRAIN_CHECK(in.layers >= 0, "PlanInputs.layers must be >= 0, got ", in.layers);
  DTRAIN_CHECK(in.fewest_stage_layers >= 0, "PlanInputs.fewest_stage_layers must be >= 0, got ",
               in.fewest_stage_layers);
  DTRAIN_CHECK(in.largest_unit_parameters >= 0, "PlanInputs.largest_unit_parameters must be >= 0, got ",
               in.largest_unit_parameters);
  DTRAIN_CHECK(in.tp >= 1 && in.dp >= 1, "PlanInputs.tp=", in.tp, " and dp=", in.dp,
               " must be >= 1");
  DTRAIN_CHECK(
      in.bytes_per_parameter == 2 || in.bytes_per_parameter == 4 || in.bytes_per_parameter == 8,
      "PlanInputs.bytes_per_parameter=", in.bytes_per_parameter,
      " must be 2 (bf16/fp16), 4 (fp32) or 8 (fp64)");
  DTRAIN_CHECK(in.buffer_bytes >= 0 && in.input_bytes_per_row >= 0 && in.input_batches >= 0 &&
                   in.optimizer_transient_bytes >= 0 && in.largest_activation_bytes_per_row >= 0 &&
                   in.cuda_context_bytes >= 0,
               "PlanInputs byte counts (buffer_bytes, input_bytes_per_row, input_batches, "
               "optimizer_transient_bytes, largest_activation_bytes_per_row, cuda_context_bytes) "
               "must be >= 0");
  offload::rule_traits(in.optimizer);  // throws for an unknown name, listing the known ones
  DTRAIN_CHECK(in.batch_size >= 1, "PlanInputs.batch_size must be >= 1, got ", in.batch_size);
  for (int a : in.accum_candidates) {
    DTRAIN_CHECK(a >= 1 && in.batch_size % a == 0, "accumulation candidate ", a,
                 " does not divide the batch of ", in.batch_size, " rows");
  }
  DTRAIN_CHECK(in.gpu_budget_bytes >= 0 && in.host_budget_bytes >= 0,
               "memory budgets must be >= 0 (0: no limit), got gpu ", in.gpu_budget_bytes,
               ", host ", in.host_budget_bytes);
  DTRAIN_CHECK(std::isfinite(in.workspace_fraction) && in.workspace_fraction >= 0 &&
                   in.workspace_fraction < 1,
               "PlanInputs.workspace_fraction=", in.workspace_fraction, " must be in [0, 1)");
  DTRAIN_CHECK(in.host_bytes_per_second > 0 && in.pcie_bytes_per_second > 0 && in.network_bytes_per_second > 0,
               "bandwidths must be positive (host ", in.host_bytes_per_second, ", pcie ",
               in.pcie_bytes_per_second, ", network ", in.network_bytes_per_second, ")");
  DTRAIN_CHECK(in.pp >= 1 && in.stage >= 0 && in.stage < in.pp, "PlanInputs.stage=", in.stage,
               " must be in [0, pp=", in.pp, ") and pp >= 1");
  DTRAIN_CHECK(in.compute_seconds_per_row >= 0 && in.micro_batch_overhead_seconds >= 0,
               "compute times must be >= 0 (0: from the probe)");
  DTRAIN_CHECK(std::isfinite(in.time_tolerance) && in.time_tolerance >= 0 && in.time_tolerance < 1,
               "PlanInputs.time_tolerance=", in.time_tolerance, " must be in [0, 1)");
}

int64_t host_budget_bytes(double host_mem_limit_gb, int local_ranks, const std::string& meminfo_path) {
  DTRAIN_CHECK(local_ranks >= 1, "host_budget_bytes: ", local_ranks, " processes on this node");
  if (host_mem_limit_gb > 0) return offload::host_limit_bytes_from_gb(host_mem_limit_gb);
  const int64_t available = offload::read_mem_available(meminfo_path);
  if (available < 0) return 0;
  const int64_t usable = std::max<int64_t>(0, available - offload::PinnedPoolOptions().min_free_bytes);
  return std::max<int64_t>(1, usable / local_ranks);  // 1 byte, not 0 ("no limit"), when nothing is free
}

int64_t ActivationFit::bytes(int64_t r) const {
  return ceil_bytes(intercept_bytes + bytes_per_row * r);
}

int64_t ActivationFit::held(int64_t r) const {
  return ceil_bytes(held_intercept_bytes + held_bytes_per_row * r);
}

int pipeline_in_flight(const PlanInputs& in, int accum_steps) {
  if (in.pp <= 1) return 1;
  switch (in.pp_schedule) {
    case PipelineSchedule::kGPipe: return accum_steps;
    case PipelineSchedule::k1F1B: return std::min(in.pp - in.stage, accum_steps);
    case PipelineSchedule::kZeroBubble: return simulate_pipeline(in.pp_schedule, in.pp, accum_steps).peak_in_flight.at(in.stage);
    case PipelineSchedule::kInterleaved:  // (micro, chunk) pairs; estimate() scales them
      return simulate_pipeline(in.pp_schedule, in.pp, accum_steps, {}, in.pp_chunks).peak_in_flight.at(in.stage);
  }
  return accum_steps;
}

const ActivationFit* ActivationProfile::find(bool checkpoint, AmpMode amp) const {
  for (const ActivationFit& f : fits) {
    if (f.checkpoint == checkpoint && f.amp == amp) return &f;
  }
  return nullptr;
}

std::string ActivationProfile::to_string() const {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  for (const ActivationFit& f : fits) {
    os << "  checkpoint " << (f.checkpoint ? "on " : "off") << ", amp " << std::setw(4)
       << engine::to_string(f.amp) << ": " << f.peak_bytes[0] / kBytesPerMiB << " MiB at " << f.rows[0]
       << " rows, " << f.peak_bytes[1] / kBytesPerMiB << " MiB at " << f.rows[1] << " rows -> "
       << f.intercept_bytes / kBytesPerMiB << " MiB + " << f.bytes_per_row / kBytesPerMiB << " MiB/row; "
       << f.seconds[0] * 1e3 << " / " << f.seconds[1] * 1e3 << " ms\n";
  }
  os << "  persistent (library workspaces): " << persistent_bytes / kBytesPerMiB << " MiB\n";
  return os.str();
}

int64_t MemoryComponents::allocated_peak() const {
  return parameters + gradients + optimizer_state + stale_gradients + other +
         std::max(activations, transient);
}

int64_t MemoryComponents::total() const { return allocated_peak() + workspace + cuda_context; }

namespace {

// Where the optimizer's state (and, with offload, the weights' host copies) lives: on the
// host for optimizer offload (the range's fp32 master, state and gradient copy) and for the
// streamed blocks; this rank's range under --shard; everything else on the device.
//
// Layer offload on a GPU updates the streamed blocks on the host with an optimizer of their
// own (make_offload_optimizer / make_layer_offload_optimizer's host part): make_optimizer()'s
// (the state in the weights' dtype, no master) for float32 weights, or an OffloadedOptimizer
// (fp32 master and state) for bf16/fp16 ones and with the delayed update (one rank: also a
// second weight buffer, and the gradients it took held while the next backward makes new
// ones). --offload=all's optimizer offload then covers only the parameters that stay on the
// device.
void add_optimizer_and_host(const PlanInputs& in, const Technique& t, int64_t nstate, int64_t local, int64_t range,
                            int64_t offloaded_layers, int64_t streamed, MemoryEstimate& e) {
  const int64_t bpp = in.bytes_per_parameter;
  const bool delayed = in.offload_delayed_update && t.shard < 3;
  // The streamed blocks' optimizer of their own (--offload=all on the CPU has one
  // OffloadedOptimizer of every parameter: no block is on another device there).
  const bool host_part = streamed > 0 && (!t.offload_optimizer || in.offload_to_device);
  const int64_t host_part_state = !host_part                ? 0
                                  : delayed || bpp == 2 ? streamed * 4 * (1 + nstate)
                                                        : streamed * bpp * nstate;
  if (t.offload_optimizer) {
    // The range the offloaded optimizer partitions: the parameters on the device, with a host part.
    const int64_t mine = host_part ? (local - offloaded_layers + in.dp - 1) / in.dp : range;
    // The CPU optimizer's shard: fp32 master weights and state; the gradients' host copy in the
    // weights' dtype (bf16/fp16 weights: ZeRO-Offload's layout; float64 ones go as float32).
    e.host.optimizer_state = mine * 4 * (1 + nstate) + host_part_state;
    // The gradients' host buffers, in the weights' dtype: the one the stream fills (GPU), or,
    // delayed, the one filling and the one updated from; none for one rank's host parameters,
    // whose delayed update takes autograd's gradients as they are. ZeRO-3's: one float32
    // buffer always.
    const bool takes_gradients = delayed && !in.offload_to_device && in.dp == 1;
    const int64_t buffers = t.shard == 3         ? 1
                            : takes_gradients    ? 0
                            : delayed            ? 2
                            : in.offload_to_device ? 1
                                                   : 0;
    e.host.gradients = buffers * mine * (t.shard == 3 ? 4 : std::min<int64_t>(bpp, 4));
    e.host.other = in.offload_to_device ? kOffloadStagingBytes : 0;
    // The update's new weights, published next step: on the device (a host part's are its
    // second weight buffer, counted below).
    if (delayed) e.gpu.optimizer_state += mine * bpp;
    // ZeRO-3's offloaded layout keeps the range's gradients in fp32 on the device for the copy
    // (fp32 weights read the reducer's buckets in place).
    if (t.shard == 3 && bpp == 2) e.gpu.optimizer_state = range * 4;
  } else if (t.shard > 0) {
    // ShardedOptimizer: the state of the range in the master dtype; bf16/fp16 weights add an
    // fp32 master copy and an fp32 gradient shard (fp32/fp64 ones read the range of the
    // reducer's buckets in place).
    const int64_t master_bytes = bpp == 2 ? 4 : bpp;
    e.gpu.optimizer_state = range * master_bytes * nstate + (bpp == 2 ? range * 4 * 2 : 0);
  } else if (in.offload_to_device) {
    e.gpu.optimizer_state = (local - offloaded_layers) * bpp * nstate;
    e.host.optimizer_state = host_part_state;
  } else {
    // The CPU: the blocks stay in the same memory. make_optimizer()'s state is the device's;
    // delayed, the blocks' OffloadedOptimizer holds its master and state in its host pool (as
    // optimizer offload does on the CPU) and the second weight buffer beside the weights (the
    // gradients it takes are released before the next backward's peak there).
    e.gpu.optimizer_state = (local - streamed) * bpp * nstate + (delayed ? streamed * bpp : host_part_state);
    if (delayed) e.host.optimizer_state = host_part_state;
  }
  if (offloaded_layers > 0) {
    e.host.parameters = offloaded_layers * bpp;
    e.host.gradients += offloaded_layers * bpp;
    e.host.other = kOffloadStagingBytes;
    if (in.offload_delayed_update) {
      // The streamed blocks' delayed update (one rank): a second page-locked weight buffer that
      // the update writes while the next step streams the first, and the gradients it took held
      // while the next backward makes new ones (the reducer keeps autograd's gradients for them,
      // beside --offload=all's stream of the device part's).
      e.host.parameters += offloaded_layers * bpp;
      e.host.gradients += offloaded_layers * bpp;
    }
  }
}

}  // namespace

MemoryEstimate estimate(const PlanInputs& in, const ActivationProfile& profile,
                        const Technique& t) {
  validate(in);
  DTRAIN_CHECK(t.accum_steps >= 1 && in.batch_size % t.accum_steps == 0,
               "accum_steps=", t.accum_steps, " does not divide the batch of ", in.batch_size,
               " rows");
  // Layer offload recomputes every streamed block in backward (engine::checkpoint around each):
  // the blocks keep what checkpointing keeps.
  const double share = recomputed_share(in, t);
  const bool partial = share > 0 && share < 1;
  DTRAIN_CHECK(t.checkpoint_blocks >= -1, "Technique.checkpoint_blocks=", t.checkpoint_blocks,
               " must be -1 (every block) or a count >= 0");
  // The fit of the technique; with some blocks recomputed, both (off and on).
  auto fit_of = [&](bool on) {
    const ActivationFit* f = profile.find(on, t.amp);
    DTRAIN_CHECK(f, "the activation profile has no measurement for checkpoint ", on ? "on" : "off", " with amp ",
                 engine::to_string(t.amp), "; add {", on ? "true" : "false", ", ", engine::to_string(t.amp),
                 "} to ProbeOptions::techniques");
    return f;
  };
  const ActivationFit* fit = fit_of(share > 0);
  const ActivationFit* off_fit = partial ? fit_of(false) : nullptr;
  MemoryEstimate e;
  e.technique = t;
  e.micro_batch_rows = in.batch_size / t.accum_steps;
  const int64_t bpp = in.bytes_per_parameter, nstate = state_tensors(in);
  const int64_t local = local_parameters(in);
  // Parameters whose weights and gradients live on the GPU: with layer offload, all but the
  // streamed blocks, plus a working set of two blocks (the one in use and the next, prefetched).
  // On the CPU nothing is streamed: the blocks stay where they are (only their recompute and,
  // delayed, their optimizer differ).
  int64_t on_gpu = local, offloaded_layers = 0, streamed = 0;
  if (t.offload_layers && in.layers > 0) {
    streamed = local_layer_parameters(in);
    if (in.offload_to_device) {
      offloaded_layers = streamed;
      const int64_t per_layer = offloaded_layers / in.layers;
      on_gpu = local - offloaded_layers + std::min(in.layers, 2) * per_layer;
    }
  }
  e.gpu.parameters = on_gpu * bpp;
  e.gpu.gradients = on_gpu * bpp;
  DTRAIN_CHECK(t.shard >= 0 && t.shard <= 3, "Technique.shard=", t.shard, " must be 0, 1, 2 or 3");
  DTRAIN_CHECK(t.shard < 3 || in.largest_unit_parameters > 0,
               "--shard=parameters: PlanInputs.largest_unit_parameters is 0 (the model names no units)");
  DTRAIN_CHECK(t.shard == 0 || !t.offload_layers,
               "--shard with --offload=layers: layer offload keeps the parameters on two devices; shard or "
               "offload layers");
  // This rank's range of the flat parameter space under --shard (ZeRO's 1/N).
  const int64_t range = (local + in.dp - 1) / in.dp;
  if (t.shard >= 2 && t.accum_steps == 1) {
    // Only the rank's range's gradients persist; the others live from their bucket's first
    // gradient to the end of backward, while the activations are being freed: they are
    // counted as a transient that does not overlap the activations' peak (exact for a stack
    // of equal layers; the sum of the two is linear through backward, so its maximum is at
    // an end).
    e.gpu.gradients = range * bpp;
    e.gpu.transient = std::max<int64_t>(e.gpu.transient, (on_gpu - range) * bpp);
  }
  // ZeRO-3: between steps this rank's range of the weights; during forward and backward the
  // unit computing and the one prefetched are whole besides (counted with the activations).
  int64_t gathered_units = 0;
  if (t.shard == 3) {
    e.gpu.parameters = range * bpp;
    gathered_units = 2 * std::min(in.largest_unit_parameters, local) * bpp;
  }
  add_optimizer_and_host(in, t, nstate, local, range, offloaded_layers, streamed, e);
  // A pipeline stage: the micro-batch in backward at its peak, the others in flight holding
  // what their forward left for their backward.
  e.in_flight = pipeline_in_flight(in, t.accum_steps);
  const int64_t rows = e.micro_batch_rows;
  // The micro-batch's peak and what it holds between forward and backward. The first k of the
  // L blocks recomputed: each saves what the off fit holds beyond the on fit, over L (exact for
  // equal blocks while the peak is backward's start, where every block's activations are), never
  // below checkpointing all of them (the peak of the last recompute).
  int64_t act_bytes = fit->bytes(rows), act_held = fit->held(rows);
  if (partial) {
    const double saved = share * static_cast<double>(std::max<int64_t>(0, off_fit->held(rows) - fit->held(rows)));
    act_bytes = std::max(fit->bytes(rows), off_fit->bytes(rows) - ceil_bytes(saved));
    act_held = std::max(fit->held(rows), off_fit->held(rows) - ceil_bytes(saved));
  }
  if (interleaved(in)) {
    // Pairs of (micro-batch, chunk), each about 1/v of the stage's held activations; the
    // backward at the peak runs one chunk's blocks with the other pairs held.
    const int64_t v = in.pp_chunks, pairs = e.in_flight;
    e.gpu.activations = act_bytes - act_held + (pairs * act_held + v - 1) / v + gathered_units;
    e.in_flight = static_cast<int>((pairs + v - 1) / v);  // reported in whole micro-batches
  } else if (in.pp > 1 && in.pp_schedule == PipelineSchedule::kZeroBubble) {
    // zb: walk the stage's list; a micro-batch holds its activations from F to W, and from B to
    // W also the gradients its boundary operations were given (none on the first stage, whose
    // B has no input to run for: its W is the whole backward). The peak of the two together.
    const int64_t held = act_held;
    const int64_t captured = in.stage == 0 ? 0 : in.weight_grad_capture_bytes_per_row * rows;
    int64_t n_held = 0, n_captured = 0, peak = 0;
    for (const PipelineAction& a : pipeline_actions(in.pp_schedule, in.pp, in.stage, t.accum_steps)) {
      if (a.kind == PipelineAction::kForward) ++n_held;
      if (a.kind == PipelineAction::kBackwardInput) ++n_captured;
      peak = std::max(peak, (n_held - 1) * held + n_captured * captured);
      if (a.kind == PipelineAction::kBackwardWeight) --n_held, --n_captured;
    }
    e.gpu.activations = act_bytes + peak + gathered_units;
  } else {
    e.gpu.activations = act_bytes + (e.in_flight - 1) * act_held + gathered_units;
  }
  e.gpu.transient = std::max(e.gpu.transient, in.optimizer_transient_bytes);
  e.gpu.stale_gradients = in.reducer_rebuild ? e.gpu.gradients : 0;
  e.gpu.other = in.buffer_bytes + profile.persistent_bytes +
                in.input_bytes_per_row * in.batch_size * in.input_batches;
  e.gpu.workspace = ceil_bytes(in.workspace_fraction * e.gpu.allocated_peak()) +
                    in.largest_activation_bytes_per_row * e.micro_batch_rows;
  e.gpu.cuda_context = in.cuda_context_bytes;
  return e;
}

std::map<std::string, double> MemoryEstimate::predicted_mb() const {
  return {{"parameters", gpu.parameters / kBytesPerMiB},
          {"gradients", gpu.gradients / kBytesPerMiB},
          {"optimizer_state", gpu.optimizer_state / kBytesPerMiB},
          {"activations", std::max(gpu.activations, gpu.transient) / kBytesPerMiB},
          {"other", (gpu.other + gpu.stale_gradients) / kBytesPerMiB},
          {"allocated", gpu.allocated_peak() / kBytesPerMiB},
          {"cuda_context", gpu.cuda_context / kBytesPerMiB},
          {"total", gpu.total() / kBytesPerMiB}};
}

std::string MemoryEstimate::to_string() const {
  std::ostringstream os;
  os << "memory estimate for " << technique.to_string() << " (micro-batch " << micro_batch_rows
     << " rows";
  if (in_flight > 1) os << ", " << in_flight << " in flight on this pipeline stage";
  os << "), MiB\n";
  os << std::fixed << std::setprecision(1);
  auto row = [&](const char* label, int64_t g, int64_t h) {
    os << "  " << std::left << std::setw(46) << label << std::right << std::setw(12) << g / kBytesPerMiB
       << std::setw(12) << h / kBytesPerMiB << "\n";
  };
  os << "  " << std::left << std::setw(46) << "component" << std::right << std::setw(12) << "GPU"
     << std::setw(12) << "host"
     << "\n";
  row("parameters", gpu.parameters, host.parameters);
  row("gradients", gpu.gradients, host.gradients);
  row("optimizer state (host: fp32 master + state)", gpu.optimizer_state, host.optimizer_state);
  row("activations (probe)", gpu.activations, host.activations);
  row("transient (optimizer temporaries)", gpu.transient, host.transient);
  row("old gradient buckets (step 2)", gpu.stale_gradients, host.stale_gradients);
  row("other (buffers, inputs, workspaces)", gpu.other, host.other);
  row("= allocated peak (activations or transient)", gpu.allocated_peak(), host.allocated_peak());
  row("workspace allowance", gpu.workspace, host.workspace);
  row("CUDA context", gpu.cuda_context, host.cuda_context);
  row("= total", gpu.total(), host.total());
  return os.str();
}

std::string Plan::to_json() const {
  nlohmann::json j;
  j["flags"] = technique.flags();
  j["checkpoint"] = technique.checkpoint;
  j["checkpoint_blocks"] = technique.checkpoint ? technique.checkpoint_blocks : -1;
  j["accum_steps"] = technique.accum_steps;
  j["amp"] = engine::to_string(technique.amp);
  j["offload"] = technique.offload_optimizer && technique.offload_layers ? "all"
                 : technique.offload_optimizer                           ? "optimizer"
                 : technique.offload_layers                              ? "layers"
                                                                         : "none";
  j["shard"] = technique.shard == 1   ? "optimizer"
               : technique.shard == 2 ? "gradients"
               : technique.shard == 3 ? "parameters"
                                      : "none";
  j["micro_batch_rows"] = estimate.micro_batch_rows;
  j["in_flight"] = estimate.in_flight;
  j["gpu_bytes"] = estimate.gpu.total();
  j["gpu_allocated_peak_bytes"] = estimate.gpu.allocated_peak();
  j["host_bytes"] = estimate.host.total();
  j["allocator_limit_bytes"] = allocator_limit_bytes;
  j["step_seconds"] = step_seconds;
  j["candidates_fitting"] = fitting.size();
  j["reason"] = reason;
  return j.dump();
}

namespace {

// estimate_step_seconds without validating the inputs again (choose_plan validated them once).
double step_seconds(const PlanInputs& in, const ActivationProfile& profile, const Technique& t) {
  if (in.step_time) {
    double s = std::numeric_limits<double>::quiet_NaN();
    try {
      s = in.step_time(t);
    } catch (const dtrain::Error&) {
    }
    if (std::isfinite(s) && s > 0) return s;
  }
  return cost_seconds(in, profile, t);
}

}  // namespace

double estimate_step_seconds(const PlanInputs& in, const ActivationProfile& profile,
                             const Technique& t) {
  validate(in);
  return step_seconds(in, profile, t);
}

Plan choose_plan(const PlanInputs& in, const ActivationProfile& profile, const PlanAgreement& agree) {
  validate(in);
  std::vector<AmpMode> amps = {in.amp};
  if (in.allow_amp_change) {
    for (AmpMode m : {AmpMode::kOff, AmpMode::kBf16, AmpMode::kFp16}) {
      if (m != in.amp && profile.find(false, m)) amps.push_back(m);
    }
  }
  std::vector<Candidate> all;
  for (AmpMode amp : amps) {
    for (int opt : {0, 1}) {
      if (opt && !in.can_offload_optimizer) continue;
      for (int layers : {0, 1}) {
        if (layers && (!in.can_offload_layers || in.layers == 0)) continue;
        for (int shard : {0, 1, 2, 3}) {
          // Offloaded state is partitioned already: with it only stage 2 adds something.
          if (shard > 0 && (!in.can_shard || in.dp == 1 || layers || (opt && shard == 1))) {
            continue;
          }
          if (shard == 3 && in.largest_unit_parameters == 0) continue;
          for (int blocks : checkpoint_candidates(in)) {  // 0: off, -1: every block
            const bool ckpt = blocks != 0;
            if ((ckpt && !in.can_checkpoint) || !profile.find(ckpt || layers, amp)) continue;
            if (blocks > 0 && !profile.find(false, amp)) continue;  // some blocks: both fits
            if (ckpt && layers) continue;  // layer offload recomputes the blocks already
            for (int accum : accum_candidates(in)) {
              Technique t{ckpt, accum, amp, opt == 1, layers == 1, shard};
              t.checkpoint_blocks = ckpt ? blocks : -1;
              Candidate c;
              c.estimate = estimate(in, profile, t);
              c.seconds = step_seconds(in, profile, c.estimate.technique);
              c.gpu = c.estimate.gpu.total();
              c.host = c.estimate.host.total();
              all.push_back(std::move(c));
            }
          }
        }
      }
    }
  }
  DTRAIN_CHECK(!all.empty(), "the activation profile has no measurement for amp ",
               engine::to_string(in.amp),
               " (checkpointing off or on); probe with that technique before planning");
  if (agree) {
    const size_t n = all.size();
    std::vector<double> figures(3 * n);
    for (size_t i = 0; i < n; ++i) {
      figures[i] = all[i].seconds;
      figures[n + i] = static_cast<double>(all[i].gpu);
      figures[2 * n + i] = static_cast<double>(all[i].host);
    }
    agree(figures);
    DTRAIN_CHECK(figures.size() == 3 * n, "choose_plan: the agreement changed the number of figures from ", 3 * n,
                 " to ", figures.size());
    for (size_t i = 0; i < n; ++i) {
      all[i].seconds = figures[i];
      all[i].gpu = static_cast<int64_t>(figures[n + i]);
      all[i].host = static_cast<int64_t>(figures[2 * n + i]);
    }
  }
  std::vector<const Candidate*> fitting;
  for (const Candidate& c : all) {
    if (fits(in, c)) fitting.push_back(&c);
  }
  DTRAIN_CHECK(!fitting.empty(), nothing_fits_message(in, all, static_cast<bool>(agree)));
  std::stable_sort(fitting.begin(), fitting.end(), [&](const Candidate* a, const Candidate* b) {
    if (a->seconds != b->seconds) return a->seconds < b->seconds;
    return techniques_used(a->estimate.technique, in.amp) < techniques_used(b->estimate.technique, in.amp);
  });
  // Those within time_tolerance of the fastest go first, simplest first (PlanInputs).
  const double tied = fitting.front()->seconds * (1.0 + in.time_tolerance);
  const auto band_end = std::find_if(fitting.begin(), fitting.end(),
                                     [&](const Candidate* c) { return c->seconds > tied; });
  std::stable_sort(fitting.begin(), band_end, [&](const Candidate* a, const Candidate* b) {
    return simplicity(in, a->estimate.technique) < simplicity(in, b->estimate.technique);
  });
  Plan plan;
  plan.technique = fitting.front()->estimate.technique;
  plan.estimate = fitting.front()->estimate;
  plan.step_seconds = fitting.front()->seconds;
  plan.reason = plan_reason(in, all, fitting, static_cast<bool>(agree));
  plan.allocator_limit_bytes =
      in.gpu_budget_bytes == 0 ? 0
                               : std::max<int64_t>(in.gpu_budget_bytes - in.cuda_context_bytes, 1);
  for (const Candidate* c : fitting) plan.fitting.push_back(c->estimate);
  return plan;
}

PlanAgreement agreement_over(dist::Communicator& comm) {
  if (comm.size() == 1) return nullptr;  // one rank agrees with itself
  return [&comm](std::vector<double>& figures) {
    // The ranks must have enumerated the same candidates (the same flags do): check first.
    const double n = static_cast<double>(figures.size());
    at::Tensor count = at::tensor({n, -n}, at::kDouble);
    comm.all_reduce(count, dist::ReduceOp::kMax)->wait();
    DTRAIN_CHECK(count[0].item<double>() == -count[1].item<double>(),
                 "--plan=auto: the ranks considered different numbers of candidate techniques (",
                 -count[1].item<double>(), " to ", count[0].item<double>(),
                 "); every rank must be given the same flags");
    at::Tensor t = at::tensor(figures, at::kDouble);
    comm.all_reduce(t, dist::ReduceOp::kMax)->wait();
    const double* p = t.data_ptr<double>();
    figures.assign(p, p + t.numel());
  };
}

}  // namespace dtrain::engine
