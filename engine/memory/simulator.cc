// The step-time simulator (simulator.h): a roofline of each block's work, alpha-beta
// collectives, the pipeline schedule simulated exactly, and an analytic memory count.
#include "dtrain/engine/memory/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <tuple>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dtrain/dist/error.h"
#include "recompute_rule.h"

namespace dtrain::engine::sim {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

std::string fmt(const char* format, double a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, a);
  return buf;
}

// ---- one block's work -----------------------------------------------------------------------

// Seconds of one matrix multiply [m, k] x [k, n] (bf16 or fp32 operands).
double matmul_seconds(const Device& d, double m, double k, double n, double flops_peak, double bytes_per_element) {
  const double flops = 2 * m * k * n;
  const double bytes = (m * k + k * n + m * n) * bytes_per_element;
  return std::max({flops / (flops_peak * d.matmul_efficiency), bytes / (d.memory_bytes_per_s * d.memory_efficiency),
                   d.kernel_seconds});
}

// Element-wise work of `bytes` moved in `kernels` kernels.
double streaming_seconds(const Device& d, double bytes, double kernels) {
  return std::max(bytes / (d.memory_bytes_per_s * d.memory_efficiency), kernels * d.kernel_seconds);
}

struct BlockTimes {
  double forward = 0;
  double backward_input = 0;   // input gradients, attention and element-wise backward
  double backward_weight = 0;  // the weight gradients' matrix multiplies
  double attention_forward = 0;
};

// One block on one rank, for t tokens of a micro-batch (its cp share), attending over S keys.
BlockTimes block_times(const ModelShape& m, const Cluster& c, const Layout& l, double t) {
  const Device& d = c.device;
  const double peak = l.bf16 ? d.peak_flops : d.fp32_flops;
  const double e = l.bf16 ? 2 : 4;
  const double h = static_cast<double>(m.d_model), ff = static_cast<double>(m.ff);
  const double tp = l.tp;
  struct Mm {
    double k, n;
  };
  std::vector<Mm> mms = {{h, (h + 2.0 * static_cast<double>(m.kv_width())) / tp}, {h / tp, h}};
  if (m.llama()) {
    mms.push_back({h, 2 * ff / tp});
    mms.push_back({ff / tp, h});
  } else {
    mms.push_back({h, ff / tp});
    mms.push_back({ff / tp, h});
  }
  BlockTimes b;
  double mm = 0;
  for (const Mm& x : mms) mm += matmul_seconds(d, t, x.k, x.n, peak, e);
  // Flash attention, causal: half of the S x S scores for each of the rank's heads.
  const double attn_flops = 2.0 * t * static_cast<double>(m.seq_len) * h / tp;
  b.attention_forward = std::max(attn_flops / (peak * d.attention_efficiency), d.kernel_seconds);
  // Element-wise: norms, residuals, rotary or biases, the activation (bytes read + written).
  // Replicated over tp unless the activations are split along the sequence.
  const double rows = l.sequence_parallel ? t / tp : t;
  const double elem_bytes = e * (rows * 16 * h + t * (m.llama() ? 6 : 4) * ff / tp);
  const double elem_kernels = m.llama() ? 14 : 12;
  const double elem = streaming_seconds(d, elem_bytes, elem_kernels);
  b.forward = mm + b.attention_forward + elem;
  b.backward_weight = mm;
  b.backward_input = mm + 2.5 * b.attention_forward + 2 * elem;
  const double scale = c.scale_at(t);
  b.forward *= scale;
  b.backward_weight *= scale;
  b.backward_input *= scale;
  b.attention_forward *= scale;
  return b;
}

// The head's logits and the loss (forward, backward) for t tokens.
std::pair<double, double> head_times(const ModelShape& m, const Cluster& c, const Layout& l, double t) {
  const Device& d = c.device;
  const double peak = l.bf16 ? d.peak_flops : d.fp32_flops;
  const double e = l.bf16 ? 2 : 4;
  const double v = static_cast<double>(m.vocab) / l.tp, h = static_cast<double>(m.d_model);
  const double mm = matmul_seconds(d, t, h, v, peak, e);
  // The loss reads the logits in float32 and writes their gradient: about four passes.
  const double loss = streaming_seconds(d, 4 * t * v * 4, 6);
  const double scale = c.scale_at(t);
  return {scale * (mm + loss / 2), scale * (2 * mm + loss / 2)};
}

double embedding_seconds(const ModelShape& m, const Cluster& c, const Layout& l, double t) {
  const double e = l.bf16 ? 2 : 4;
  return c.scale_at(t) * streaming_seconds(c.device, 3 * t * static_cast<double>(m.d_model) * e, 3);
}

// ---- memory ---------------------------------------------------------------------------------

// Bytes of the activations one block keeps for backward, for t tokens (Korthikanti et al. 2022,
// with flash attention: no score matrix; 16-bit activations, or 32-bit without AMP).
double block_activation_bytes(const ModelShape& m, const Layout& l, double t) {
  const double h = static_cast<double>(m.d_model), ff = static_cast<double>(m.ff), tp = l.tp;
  const double e = l.bf16 ? 2 : 4;
  // Replicated (norm inputs, residual path, the attention and MLP inputs without sequence
  // parallelism): 5 h; split over tp: q, k, v, attention output, the MLP's hidden activations.
  const double replicated = 5 * h / (l.sequence_parallel ? tp : 1);
  const double split = (h + 2.0 * static_cast<double>(m.kv_width()) + h + (m.llama() ? 3 : 2) * ff) / tp;
  return t * e * (replicated + split);
}

}  // namespace

// ---- the model ------------------------------------------------------------------------------

int64_t ModelShape::kv_width() const { return (kv_heads > 0 ? kv_heads : heads) * (d_model / heads); }

int64_t ModelShape::block_parameters() const {
  const int64_t d = d_model;
  if (llama()) return 2 * d + d * d + 2 * d * kv_width() + d * d + 3 * d * ff;
  return 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * ff + ff) + (ff * d + d);
}

int64_t ModelShape::embedding_parameters() const { return vocab * d_model + (llama() ? 0 : seq_len * d_model); }

int64_t ModelShape::head_parameters() const {
  const int64_t norm = llama() ? d_model : 2 * d_model;
  return norm + (tie_embeddings ? 0 : vocab * d_model);
}

int64_t ModelShape::parameters() const {
  return embedding_parameters() + layers * block_parameters() + head_parameters();
}

double ModelShape::flops_per_token() const {
  return 6.0 * static_cast<double>(parameters()) + 12.0 * static_cast<double>(layers * d_model * seq_len);
}

std::string ModelShape::to_string() const {
  std::ostringstream s;
  s << family << " " << fmt("%.1f", static_cast<double>(parameters()) / 1e6) << "M: " << layers << " layers, d "
    << d_model << ", " << heads << " heads";
  if (kv_heads > 0 && kv_heads != heads) s << " (" << kv_heads << " kv)";
  s << ", ff " << ff << ", vocab " << vocab << ", seq " << seq_len << (tie_embeddings ? ", tied head" : "");
  return s.str();
}

ModelShape model_from_hf_config(const std::string& json_text, int64_t seq_len) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    DTRAIN_CHECK(false, "the model's config.json is not JSON (", e.what(), ")");
  }
  auto get = [&](const char* key, int64_t fallback) -> int64_t {
    if (!j.contains(key) || j[key].is_null()) {
      DTRAIN_CHECK(fallback >= 0, "config.json lacks \"", key, "\"; give the model's Hugging Face config.json");
      return fallback;
    }
    DTRAIN_CHECK(j[key].is_number_integer() && j[key].get<int64_t>() > 0, "config.json's \"", key,
                 "\" must be a positive integer");
    return j[key].get<int64_t>();
  };
  ModelShape m;
  const std::string type = j.value("model_type", std::string());
  if (type == "gpt2") {
    m.family = "gpt";
    m.layers = get("n_layer", -1);
    m.d_model = get("n_embd", -1);
    m.heads = get("n_head", -1);
    m.ff = get("n_inner", 4 * m.d_model);
    m.vocab = get("vocab_size", -1);
    m.seq_len = get("n_positions", 1024);
    m.tie_embeddings = j.value("tie_word_embeddings", true);
  } else {
    m.family = "llama";
    m.layers = get("num_hidden_layers", -1);
    m.d_model = get("hidden_size", -1);
    m.heads = get("num_attention_heads", -1);
    m.kv_heads = get("num_key_value_heads", m.heads);
    m.ff = get("intermediate_size", -1);
    m.vocab = get("vocab_size", -1);
    m.seq_len = get("max_position_embeddings", 2048);
    m.tie_embeddings = j.value("tie_word_embeddings", false);
  }
  DTRAIN_CHECK(m.d_model % m.heads == 0, "config.json: the hidden size ", m.d_model, " is not a multiple of the ",
               m.heads, " heads");
  if (seq_len > 0) m.seq_len = seq_len;
  return m;
}

// ---- devices and clusters -------------------------------------------------------------------

Device named_device(const std::string& name) {
  Device d;
  d.name = name;
  if (name == "h100") return d;
  if (name == "h200") {
    d.memory_bytes_per_s = 4.8e12;
    d.memory_bytes = 143771 * kMiB;  // nvidia-smi's total (docs/gpu/2026-11-27)
    return d;
  }
  if (name == "a100" || name == "a100-40gb") {
    d.peak_flops = 312e12;
    d.fp32_flops = 19.5e12;
    d.memory_bytes_per_s = name == "a100" ? 2.039e12 : 1.555e12;
    d.memory_bytes = (name == "a100" ? 80 : 40) * kGiB;
    d.kernel_seconds = 5e-6;
    return d;
  }
  DTRAIN_CHECK(false, "--gpu=", name, " is not a device kind the simulator knows: h100, h200, a100, a100-40gb (or give a "
              "calibration file with --cluster)");
}

std::string Cluster::to_string() const {
  std::ostringstream s;
  s << nodes << " node" << (nodes > 1 ? "s" : "") << " x " << gpus_per_node << " " << device.name << " ("
    << fmt("%.0f", device.peak_flops / 1e12) << " TFLOP/s, " << fmt("%.0f", device.memory_bytes / kGiB)
    << " GiB), links " << fmt("%.0f", intra.bytes_per_s / 1e9) << " GB/s inside a node, "
    << fmt("%.0f", inter.bytes_per_s / 1e9) << " GB/s between nodes";
  return s.str();
}

std::string Cluster::to_json() const {
  nlohmann::json j;
  j["nodes"] = nodes;
  j["gpus_per_node"] = gpus_per_node;
  nlohmann::json dj;
  dj["name"] = device.name;
  dj["peak_flops"] = device.peak_flops;
  dj["fp32_flops"] = device.fp32_flops;
  dj["memory_bytes_per_s"] = device.memory_bytes_per_s;
  dj["memory_bytes"] = device.memory_bytes;
  dj["matmul_efficiency"] = device.matmul_efficiency;
  dj["attention_efficiency"] = device.attention_efficiency;
  dj["memory_efficiency"] = device.memory_efficiency;
  dj["kernel_seconds"] = device.kernel_seconds;
  dj["context_bytes"] = device.context_bytes;
  dj["cores"] = device.cores;
  j["device"] = dj;
  j["intra"] = {{"bytes_per_s", intra.bytes_per_s}, {"latency_s", intra.latency_s}};
  j["inter"] = {{"bytes_per_s", inter.bytes_per_s}, {"latency_s", inter.latency_s}};
  j["pcie_bytes_per_s"] = pcie_bytes_per_s;
  j["host_bytes_per_s"] = host_bytes_per_s;
  j["host_memory_bytes"] = host_memory_bytes;
  j["micro_batch_overhead_s"] = micro_batch_overhead_s;
  j["step_overhead_s"] = step_overhead_s;
  j["compute_scale"] = compute_scale;
  j["compute_scale_points"] = nlohmann::json::array();
  for (const auto& [tokens, scale] : compute_scale_points) j["compute_scale_points"].push_back({tokens, scale});
  if (!calibrated_model.empty()) j["calibrated_model"] = calibrated_model;
  return j.dump(2);
}

Cluster cluster_from_json(const std::string& json_text, const Cluster& defaults) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    DTRAIN_CHECK(false, "the cluster file is not JSON (", e.what(), "); write it with dtrain-plan --calibrate");
  }
  Cluster c = defaults;
  // Every key known: a misspelled one would leave its default in place without a word.
  auto known = [](const nlohmann::json& o, const char* where, std::initializer_list<const char*> keys) {
    DTRAIN_CHECK(o.is_object(), "the cluster file's ", where, " must be a JSON object; write the file with dtrain-plan "
                 "--calibrate");
    for (const auto& item : o.items()) {
      bool found = false;
      std::string names;
      for (const char* k : keys) {
        found = found || item.key() == k;
        names += std::string(names.empty() ? "" : ", ") + k;
      }
      DTRAIN_CHECK(found, "the cluster file's ", where, " has \"", item.key(), "\", which the simulator does not read (",
                   "known: ", names, "); check its spelling");
    }
  };
  known(j, "top level",
        {"nodes", "gpus_per_node", "device", "intra", "inter", "pcie_bytes_per_s", "host_bytes_per_s",
         "host_memory_bytes", "micro_batch_overhead_s", "step_overhead_s", "compute_scale", "compute_scale_points",
         "calibrated_model"});
  auto number = [](const nlohmann::json& o, const char* key, double& out, bool positive, double max = 0) {
    if (!o.contains(key)) return;
    DTRAIN_CHECK(o[key].is_number(), "the cluster file's \"", key, "\" must be a number");
    const double v = o[key].get<double>();
    DTRAIN_CHECK(std::isfinite(v) && (positive ? v > 0 : v >= 0), "the cluster file's \"", key, "\" is ", v,
                 "; it must be ", positive ? "> 0" : ">= 0");
    DTRAIN_CHECK(max == 0 || v <= max, "the cluster file's \"", key, "\" is ", v, "; it is a share of the peak, at most ",
                 max);
    out = v;
  };
  auto integer = [&](const nlohmann::json& o, const char* key, int& out, int min) {
    double v = out;
    number(o, key, v, false);
    DTRAIN_CHECK(v >= min && v == std::floor(v), "the cluster file's \"", key, "\" must be an integer >= ", min);
    out = static_cast<int>(v);
  };
  integer(j, "nodes", c.nodes, 1);
  integer(j, "gpus_per_node", c.gpus_per_node, 1);
  if (j.contains("device")) {
    const nlohmann::json& d = j["device"];
    known(d, "\"device\"",
          {"name", "peak_flops", "fp32_flops", "memory_bytes_per_s", "memory_bytes", "matmul_efficiency",
           "attention_efficiency", "memory_efficiency", "kernel_seconds", "context_bytes", "cores"});
    if (d.contains("name")) {
      DTRAIN_CHECK(d["name"].is_string(), "the cluster file's device \"name\" must be a string");
      c.device.name = d["name"].get<std::string>();
    }
    number(d, "peak_flops", c.device.peak_flops, true);
    number(d, "fp32_flops", c.device.fp32_flops, true);
    number(d, "memory_bytes_per_s", c.device.memory_bytes_per_s, true);
    number(d, "memory_bytes", c.device.memory_bytes, true);
    number(d, "matmul_efficiency", c.device.matmul_efficiency, true, 1);
    number(d, "attention_efficiency", c.device.attention_efficiency, true, 1);
    number(d, "memory_efficiency", c.device.memory_efficiency, true, 1);
    number(d, "kernel_seconds", c.device.kernel_seconds, false);
    number(d, "context_bytes", c.device.context_bytes, false);
    integer(d, "cores", c.device.cores, 0);
  }
  for (auto [key, link] : {std::pair<const char*, Link*>{"intra", &c.intra}, {"inter", &c.inter}}) {
    if (!j.contains(key)) continue;
    known(j[key], key == std::string("intra") ? "\"intra\"" : "\"inter\"", {"bytes_per_s", "latency_s"});
    number(j[key], "bytes_per_s", link->bytes_per_s, true);
    number(j[key], "latency_s", link->latency_s, false);
  }
  number(j, "pcie_bytes_per_s", c.pcie_bytes_per_s, true);
  number(j, "host_bytes_per_s", c.host_bytes_per_s, true);
  number(j, "host_memory_bytes", c.host_memory_bytes, true);
  number(j, "micro_batch_overhead_s", c.micro_batch_overhead_s, false);
  number(j, "step_overhead_s", c.step_overhead_s, false);
  number(j, "compute_scale", c.compute_scale, true);
  if (j.contains("calibrated_model")) {
    DTRAIN_CHECK(j["calibrated_model"].is_string(), "the cluster file's \"calibrated_model\" must be a string");
    c.calibrated_model = j["calibrated_model"].get<std::string>();
  }
  if (j.contains("compute_scale_points")) {
    const nlohmann::json& pts = j["compute_scale_points"];
    DTRAIN_CHECK(pts.is_array(), "the cluster file's \"compute_scale_points\" must be a list of [tokens, scale]");
    c.compute_scale_points.clear();
    for (const auto& pt : pts) {
      DTRAIN_CHECK(pt.is_array() && pt.size() == 2 && pt[0].is_number() && pt[1].is_number() &&
                       pt[0].get<double>() > 0 && pt[1].get<double>() > 0,
                   "the cluster file's \"compute_scale_points\" must be [tokens, scale] pairs of positive numbers");
      DTRAIN_CHECK(c.compute_scale_points.empty() || pt[0].get<double>() > c.compute_scale_points.back().first,
                   "the cluster file's \"compute_scale_points\" must be in increasing tokens");
      c.compute_scale_points.emplace_back(pt[0].get<double>(), pt[1].get<double>());
    }
  }
  return c;
}

double Cluster::scale_at(double tokens) const {
  const auto& p = compute_scale_points;
  if (p.empty()) return compute_scale;
  if (tokens <= p.front().first) return p.front().second;
  if (tokens >= p.back().first) return p.back().second;
  for (size_t i = 1; i < p.size(); ++i) {
    if (tokens > p[i].first) continue;
    const double w = std::log(tokens / p[i - 1].first) / std::log(p[i].first / p[i - 1].first);
    return p[i - 1].second + w * (p[i].second - p[i - 1].second);
  }
  return p.back().second;
}

// ---- layouts --------------------------------------------------------------------------------

std::string Layout::to_string() const {
  std::ostringstream s;
  s << "dp " << dp << " tp " << tp << " pp " << pp << " cp " << cp << " zero " << zero << " mb " << micro_batch_rows
    << "x" << accum_steps;
  if (pp > 1) s << " " << engine::to_string(schedule) << (chunks > 1 ? "/" + std::to_string(chunks) : "");
  if (!stage_blocks.empty()) s << " blocks " << stage_blocks;
  if (checkpoint) s << " ckpt" << (checkpoint_blocks >= 0 ? " " + std::to_string(checkpoint_blocks) : "");
  if (sequence_parallel) s << " sp";
  if (offload_optimizer) s << " offload-opt";
  if (offload_layers) s << " offload-layers";
  if (delayed_update) s << " delayed";
  if (!bf16) s << " fp32";
  if (param_bf16) s << " bf16-weights";
  return s.str();
}

std::string Layout::flags() const {
  std::ostringstream s;
  auto add = [&](const std::string& f) { s << (s.tellp() > 0 ? " " : "") << f; };
  if (tp > 1) add("--tp=" + std::to_string(tp));
  if (pp > 1) add("--pp=" + std::to_string(pp));
  if (cp > 1) add("--cp=" + std::to_string(cp));
  if (pp > 1 && schedule != PipelineSchedule::k1F1B)
    add(std::string("--pp_schedule=") + engine::to_string(schedule));
  if (chunks > 1) add("--pp_chunks=" + std::to_string(chunks));
  if (!stage_blocks.empty()) add("--pp_blocks=" + stage_blocks);
  add("--batch_size=" + std::to_string(micro_batch_rows * accum_steps));
  if (accum_steps > 1) add("--accum_steps=" + std::to_string(accum_steps));
  static const char* const kShard[] = {"", "optimizer", "gradients", "parameters"};
  if (zero > 0) add(std::string("--shard=") + kShard[zero]);
  if (offload_optimizer || offload_layers)
    add(std::string("--offload=") + (offload_optimizer && offload_layers ? "all" : offload_optimizer ? "optimizer" : "layers"));
  // Two ordinary steps first (as the GPU session runs it); the figures are the steady state's.
  if (delayed_update) add("--offload_delayed_update_after=2");
  if (checkpoint) add("--checkpoint_activations");
  if (checkpoint && checkpoint_blocks >= 0) add("--checkpoint_blocks=" + std::to_string(checkpoint_blocks));
  if (sequence_parallel) add("--sequence_parallel");
  if (bf16) add("--amp=bf16");
  if (param_bf16) add("--param_dtype=bf16");
  return s.str();
}

double allreduce_seconds(double bytes, int n, const Link& link) {
  if (n <= 1 || bytes <= 0) return 0;
  return 2.0 * (n - 1) / n * bytes / link.bytes_per_s + 2.0 * (n - 1) * link.latency_s;
}

double allgather_seconds(double bytes, int n, const Link& link) {
  if (n <= 1 || bytes <= 0) return 0;
  return static_cast<double>(n - 1) / n * bytes / link.bytes_per_s + (n - 1) * link.latency_s;
}

namespace {
// Whether a group of n ranks, stride apart, lies inside one node.
bool group_in_node(const Cluster& cluster, int n, int stride) {
  const int64_t span = static_cast<int64_t>(n - 1) * stride + 1;
  return span <= cluster.gpus_per_node &&
         cluster.gpus_per_node % std::min<int64_t>(cluster.gpus_per_node, int64_t{n} * stride) == 0;
}
}  // namespace

const Link& group_link(const Cluster& cluster, int n, int stride) {
  return group_in_node(cluster, n, stride) ? cluster.intra : cluster.inter;
}

namespace {
void validate_layout(int64_t layers, const Cluster& c, const Layout& l);
}  // namespace

void validate(const ModelShape& m, const Cluster& c, const Layout& l) {
  DTRAIN_CHECK(m.layers >= 1 && m.d_model >= 1 && m.heads >= 1 && m.ff >= 1 && m.vocab >= 1 && m.seq_len >= 1,
               "the model's sizes must be >= 1 (", m.to_string(), ")");
  DTRAIN_CHECK(m.d_model % m.heads == 0, "d_model ", m.d_model, " is not a multiple of the ", m.heads, " heads");
  validate_layout(m.layers, c, l);
  const int64_t kv = m.kv_heads > 0 ? m.kv_heads : m.heads;
  DTRAIN_CHECK(m.heads % l.tp == 0 && kv % l.tp == 0 && m.ff % l.tp == 0, "tp ", l.tp,
               " does not divide the heads (", m.heads, "), key/value heads (", kv, ") and ff (", m.ff, ")");
  DTRAIN_CHECK(l.cp == 1 || m.seq_len % (2 * l.cp) == 0, "cp ", l.cp, " needs seq_len (", m.seq_len,
               ") to be a multiple of 2 cp = ", 2 * l.cp, " (the balanced split)");
  DTRAIN_CHECK(!l.sequence_parallel || m.seq_len % (l.tp * (l.cp > 1 ? 2 * l.cp : 1)) == 0,
               "sequence parallelism splits each rank's ", m.seq_len / l.cp, " tokens over tp ", l.tp,
               ": seq_len (", m.seq_len, ") must be a multiple of ", l.tp * (l.cp > 1 ? 2 * l.cp : 1));
}

std::string dtrain_limitation(const Layout& l, bool tied_embeddings) {
  // One tensor under two names (the head is the embedding): ZeRO-3's units own each weight once,
  // and pipeline stages may hold the two uses on different ranks.
  if (tied_embeddings && l.zero == 3) return "tied embeddings with ZeRO-3";
  if (tied_embeddings && l.pp > 1) return "tied embeddings with pipeline stages";
  // A GPU's layer offload keeps parameters on two devices, and ZeRO's flat shards are one
  // device's (a CPU run, where nothing is streamed, does run them together).
  if (l.offload_layers && l.zero > 0) return "layer offload with ZeRO";
  if (l.pp > 1 && l.schedule == PipelineSchedule::kZeroBubble && l.offload_layers) return "zb with layer offload";
  if (l.param_bf16 && l.zero == 0 && !l.offload_optimizer) return "bf16 weights without ZeRO or optimizer offload";
  if (l.delayed_update && l.pp > 1) return "the delayed update with pipeline stages";
  if (l.delayed_update && l.zero == 3 && l.offload_optimizer) return "the delayed update with ZeRO-3 offload";
  // The streamed blocks' own update is one rank's.
  if (l.delayed_update && l.offload_layers && l.dp * l.cp > 1) return "layer offload's delayed update on more than one replica";
  return "";
}

// ---- the prediction -------------------------------------------------------------------------

namespace {

// What pricing a step needs of a model, per micro-batch on one rank (its tp and cp share), from
// the roofline of a ModelShape or from a MeasuredModel's timings.
struct StepCosts {
  int64_t layers = 0;
  BlockTimes block;
  double tp_per_block = 0;          // tensor-parallel all-reduces of a block, each direction
  double cp_fwd = 0, cp_bwd = 0;    // a block's exposed ring time
  double first_f = 0, first_b = 0;  // what runs before the blocks (first stage)
  double last_f = 0, last_b = 0;    // after them: the head and the loss (last stage)
  double act_bytes = 0;             // a stage's message (the blocks' input)
  double block_params = 0;          // one block's parameters on this rank
  double first_params = 0, last_params = 0;
  double block_held_bytes = 0;      // what a block keeps for backward
  double block_input_bytes = 0;     // what a checkpointed block keeps (its input)
  double block_capture_bytes = 0;   // zb: the gradients a block's boundary operations keep from B to W
  double ends_held_bytes = 0;       // the ends' (the logits and their gradient)
  double autocast_copy_bytes = 0;   // AMP's low-precision weight copies alive at once
  double tokens_per_row = 1;
  double flops_per_token = 0;       // 0: no MFU
};

StepCosts roofline_costs(const ModelShape& m, const Cluster& c, const Layout& l) {
  StepCosts k;
  const double e = l.bf16 ? 2 : 4;
  const double S = static_cast<double>(m.seq_len);
  const double t = static_cast<double>(l.micro_batch_rows) * S / l.cp;  // tokens per micro-batch per rank
  const double h = static_cast<double>(m.d_model);
  k.layers = m.layers;
  k.block = block_times(m, c, l, t);
  const auto [head_f, head_b] = head_times(m, c, l, t);
  const double embed = embedding_seconds(m, c, l, t);
  k.first_f = k.first_b = embed;
  k.last_f = head_f, k.last_b = head_b;
  k.act_bytes = t * h * e;
  k.tp_per_block = l.tp > 1 ? 2 * allreduce_seconds(k.act_bytes, l.tp, group_link(c, l.tp, 1)) : 0;
  if (l.cp > 1) {
    const Link& cp_link = group_link(c, l.cp, l.tp);
    const double kv_bytes = 2 * t * static_cast<double>(m.kv_width()) / l.tp * e;
    const double step_comm = kv_bytes / cp_link.bytes_per_s + cp_link.latency_s;
    const double step_compute = k.block.attention_forward / l.cp;
    k.cp_fwd = (l.cp - 1) * std::max(0.0, step_comm - step_compute);
    k.cp_bwd = (l.cp - 1) * std::max(0.0, 2 * step_comm - 2.5 * step_compute);
  }
  k.block_params = static_cast<double>(m.block_parameters()) / l.tp;
  k.first_params = static_cast<double>(m.embedding_parameters()) / l.tp;
  k.last_params = static_cast<double>(m.head_parameters()) / l.tp;
  k.block_held_bytes = block_activation_bytes(m, l, t);
  k.block_input_bytes = t * h * e;
  // Every Linear's output in the activations' dtype (column-parallel ones split over tp, the
  // row-parallel projections back to d whole), every norm's in float32.
  const double ff = static_cast<double>(m.ff);
  const double linear_out = m.llama() ? (h + 2.0 * static_cast<double>(m.kv_width()) + 2 * ff) / l.tp + 2 * h
                                      : (3 * h + ff) / l.tp + 2 * h;
  k.block_capture_bytes = t * (linear_out * e + 2 * h * 4);
  // The logits and the loss: on a GPU dtrain's fused cross-entropy (cross_entropy.h) keeps the
  // logits and writes their gradient in their dtype; elsewhere ATen's composition adds a float32
  // copy and the softmax it keeps.
  const bool fused_loss = c.device.cores == 0;
  k.ends_held_bytes = t * static_cast<double>(m.vocab) / l.tp * (fused_loss ? 2 * e : e + 4 + 4);
  k.autocast_copy_bytes = l.bf16 && !l.param_bf16 ? 2 * k.block_params * 2 : 0;
  k.tokens_per_row = S;
  k.flops_per_token = m.flops_per_token();
  return k;
}

// The layout checks that do not depend on the model's shape.
void validate_layout(int64_t layers, const Cluster& c, const Layout& l) {
  DTRAIN_CHECK(c.nodes >= 1 && c.gpus_per_node >= 1, "the cluster needs at least one node of one GPU");
  DTRAIN_CHECK(l.dp >= 1 && l.tp >= 1 && l.pp >= 1 && l.cp >= 1 && l.micro_batch_rows >= 1 && l.accum_steps >= 1 &&
                   l.chunks >= 1,
               "the layout's sizes must be >= 1 (", l.to_string(), ")");
  DTRAIN_CHECK(l.ranks() == c.ranks(), "the layout ", l.to_string(), " uses ", l.ranks(), " ranks; the cluster has ",
               c.ranks(), " (", c.nodes, " x ", c.gpus_per_node, ")");
  DTRAIN_CHECK(l.pp * l.chunks <= layers, "pp ", l.pp, " x ", l.chunks, " chunks is more stages than the ", layers,
               " layers");
  DTRAIN_CHECK(l.zero >= 0 && l.zero <= 3, "zero ", l.zero, " is not a ZeRO stage (0-3)");
  DTRAIN_CHECK(l.zero == 0 || l.dp * l.cp > 1, "zero ", l.zero, " shards over the replicas, and there is one");
  DTRAIN_CHECK(!(l.sequence_parallel && l.tp == 1), "sequence parallelism needs tp > 1");
  DTRAIN_CHECK(!l.delayed_update || l.offload_optimizer || l.offload_layers,
               "the delayed update is the host update's: it needs optimizer or layer offload");
  DTRAIN_CHECK(l.checkpoint_blocks >= -1, "checkpoint_blocks ", l.checkpoint_blocks,
               " must be -1 (every block) or a count >= 0");
  DTRAIN_CHECK(l.checkpoint || l.checkpoint_blocks == -1, "checkpoint_blocks ", l.checkpoint_blocks,
               " chooses the blocks checkpointing recomputes, and it is off");
  DTRAIN_CHECK(l.stage_blocks.empty() || l.pp > 1, "stage_blocks (--pp_blocks=", l.stage_blocks, ") needs pp > 1");
  DTRAIN_CHECK(l.stage_blocks.empty() || l.schedule != PipelineSchedule::kInterleaved,
               "stage_blocks (--pp_blocks) with the interleaved schedule is not priced: its chunks are even");
  int64_t smallest = layers / l.pp;
  if (!l.stage_blocks.empty()) {
    const std::vector<int> b = pipeline_stage_bounds(static_cast<int>(layers), l.pp, l.stage_blocks);
    for (int s = 0; s < l.pp; ++s) smallest = std::min<int64_t>(smallest, b[s + 1] - b[s]);
  }
  DTRAIN_CHECK(l.checkpoint_blocks <= smallest, "checkpoint_blocks ", l.checkpoint_blocks,
               " is more than the smallest stage's ", smallest, " blocks");
  if (l.pp > 1) {
    if (l.schedule == PipelineSchedule::kInterleaved) {
      DTRAIN_CHECK(l.chunks >= 2, "the interleaved schedule needs chunks >= 2");
      DTRAIN_CHECK(layers % (l.pp * l.chunks) == 0, "the interleaved schedule needs the layers (", layers,
                   ") to divide into pp x chunks = ", l.pp * l.chunks, " chunks");
      DTRAIN_CHECK(l.accum_steps % l.pp == 0, "the interleaved schedule needs accum_steps (", l.accum_steps,
                   ") to be a multiple of pp ", l.pp);
    } else {
      DTRAIN_CHECK(l.chunks == 1, "chunks > 1 is the interleaved schedule's");
      DTRAIN_CHECK(l.schedule == PipelineSchedule::kGPipe || l.accum_steps >= l.pp, "accum_steps ", l.accum_steps,
                   " is fewer micro-batches than the ", l.pp, " stages of ", engine::to_string(l.schedule));
    }
  } else {
    DTRAIN_CHECK(l.chunks == 1, "chunks > 1 needs pp > 1");
  }
}

// simulate_pipeline of a schedule at these costs (zb: its lists ordered at them), remembered: a
// search prices hundreds of layouts per mesh whose techniques (ZeRO stage, offload, sequence
// parallelism, the weights' dtype) leave the stages' costs as they are, and the schedule's
// simulation is most of a pipeline layout's price. Per thread; forgotten past 4096 entries.
SimulatedPipeline simulated_pipeline(PipelineSchedule schedule, int stages, int micro_batches, const PipelineCosts& costs,
                                     int chunks) {
  using Key = std::tuple<int, int, int, int, double, double, double>;
  thread_local std::map<Key, SimulatedPipeline> memo;
  const Key key{static_cast<int>(schedule), stages, micro_batches, chunks, costs.forward, costs.backward_input,
                costs.backward_weight};
  auto it = memo.find(key);
  if (it != memo.end()) return it->second;
  if (memo.size() >= 4096) memo.clear();
  const bool zb = schedule == PipelineSchedule::kZeroBubble;
  return memo.emplace(key, simulate_pipeline(schedule, stages, micro_batches, costs, chunks, zb ? &costs : nullptr))
      .first->second;
}

Prediction price(const StepCosts& k, const Cluster& c, const Layout& l) {
  Prediction p;
  p.layout = l;
  // The blocks of a stage of `layers` recomputed in backward (recompute_rule.h).
  auto recomputed_blocks = [&l](double layers) {
    return recompute::recomputed_blocks(layers, l.checkpoint, l.checkpoint_blocks, l.offload_layers);
  };
  const Device& d = c.device;
  const int M = l.accum_steps;
  const BlockTimes& b = k.block;
  // A CPU's ranks share its cores (Device::cores): the node's work at full speed, shared, takes
  // `share` times as long, unless waiting (a pipeline's bubble) leaves the cores to the others.
  const double share = d.cores > 0 && c.gpus_per_node > d.cores ? static_cast<double>(c.gpus_per_node) / d.cores : 1.0;
  // The mesh (pp, dp, cp, tp from the outside in): each axis's stride and link.
  const int replicas = l.dp * l.cp;
  const bool dp_in_node = group_in_node(c, replicas, l.tp);  // dp x cp: tp-strided ranks of a stage
  const Link& dp_link = dp_in_node ? c.intra : c.inter;
  const Link& pp_link = group_link(c, 2, l.tp * l.cp * l.dp);
  // Each stage's blocks (pipeline_stage_bounds: --pp_blocks, or dtrain's even split with the
  // remainder to the later stages), and the largest stage's count (for memory).
  const std::vector<int> bounds = pipeline_stage_bounds(static_cast<int>(k.layers), l.pp, l.stage_blocks);
  int64_t stage_layers = 0;
  for (int s = 0; s < l.pp; ++s) stage_layers = std::max<int64_t>(stage_layers, bounds[s + 1] - bounds[s]);
  const double tp_per_block = k.tp_per_block, cp_fwd = k.cp_fwd, cp_bwd = k.cp_bwd;
  const double recompute = b.forward + tp_per_block + cp_fwd;  // one recomputed block's
  // Each stage's work per micro-batch (dtrain's split: pipeline_stage_bounds; the first stage
  // also runs what comes before the blocks, the last the head and the loss): forward,
  // input-gradient and weight-gradient halves of backward, and its compute alone.
  struct StageWork {
    double f = 0, bi = 0, bw = 0, compute = 0, layers = 0, recomputed = 0;
    double total() const { return f + bi + bw; }
  };
  std::vector<StageWork> stages(l.pp);
  StageWork avg;
  size_t slowest = 0;
  for (int s = 0; s < l.pp; ++s) {
    StageWork& w = stages[s];
    w.layers = bounds[s + 1] - bounds[s];
    w.recomputed = recomputed_blocks(w.layers);
    const double end_f = (s == 0 ? k.first_f : 0) + (s == l.pp - 1 ? k.last_f : 0);
    const double end_b = (s == 0 ? k.first_b : 0) + (s == l.pp - 1 ? k.last_b : 0);
    w.f = w.layers * (b.forward + tp_per_block + cp_fwd) + end_f;
    w.bw = w.layers * b.backward_weight;
    w.bi = w.layers * (b.backward_input + tp_per_block + cp_bwd) + w.recomputed * recompute + end_b;
    w.compute = w.layers * (b.forward + b.backward_input + b.backward_weight) + w.recomputed * b.forward + end_f + end_b;
    avg.f += w.f / l.pp, avg.bi += w.bi / l.pp, avg.bw += w.bw / l.pp;
    if (w.total() > stages[slowest].total()) slowest = s;
  }
  const StageWork& worst = stages[slowest];
  const double L = worst.layers, R = worst.recomputed;
  const double block_p = k.block_params;
  // Layer offload: the stage's blocks, streamed from the host.
  const double streamed = l.offload_layers ? static_cast<double>(stage_layers) * block_p : 0.0;
  // The ranks sharing a node's host (its memory bandwidth for host-side updates, its memory).
  const int ranks_per_node = std::min(c.gpus_per_node, l.ranks());
  const double host_bw = c.host_bytes_per_s / ranks_per_node;
  // Gradients and weights in the weights' dtype.
  const double wbytes = l.param_bf16 ? 2 : 4;
  // Layer offload: each block's weights come in twice (forward and the recompute) and its
  // gradients go out once, behind its compute (a micro-batch's copies against its compute,
  // whichever is longer).
  if (l.offload_layers) {
    const double copy = L * block_p * 3 * wbytes / c.pcie_bytes_per_s;
    if (copy > worst.total()) p.parts.offload += M * (copy - worst.total());
  }
  p.parts.compute = M * worst.compute;
  p.parts.tensor_parallel = M * (2 * L + R) * tp_per_block;
  p.parts.context_parallel = M * (L * (cp_fwd + cp_bwd) + R * cp_fwd);
  double pipeline = M * worst.total();
  int in_flight = 1;
  if (l.pp > 1) {
    // The schedule at the stages' mean costs, plus what the slowest stage adds to each of its
    // micro-batches (the steady state runs at its pace).
    const double p2p = k.act_bytes / pp_link.bytes_per_s + pp_link.latency_s;
    const double chunks = l.chunks;
    PipelineCosts costs;
    costs.forward = (avg.f + p2p) / chunks;
    costs.backward_input = (avg.bi + p2p) / chunks;
    costs.backward_weight = avg.bw / chunks;
    const bool zb = l.schedule == PipelineSchedule::kZeroBubble;
    const SimulatedPipeline sp = simulated_pipeline(l.schedule, l.pp, M, costs, l.chunks);
    if (zb) p.zb_costs = costs;
    pipeline = sp.step + M * (worst.total() - avg.total());
    in_flight = sp.peak_in_flight.empty() ? 1 : sp.peak_in_flight[0];
  }
  // Shared cores: the node's work (its ranks' mean busy time) spread over its cores, or the
  // schedule's step, whichever is longer (a stage that waits leaves its core to the others).
  const double busy = M * worst.total();
  pipeline = std::max(pipeline, share * M * avg.total());
  p.parts.pipeline_bubble = std::max(0.0, pipeline - share * busy);
  p.parts.compute *= share;
  p.parts.tensor_parallel *= share;
  p.parts.context_parallel *= share;
  p.in_flight = in_flight;
  p.parts.overhead = M * c.micro_batch_overhead_s + c.step_overhead_s;

  // Parameters of the largest stage, on one tensor-parallel rank.
  const double stage_params = static_cast<double>(stage_layers) * block_p + std::max(k.first_params, k.last_params) +
                              (l.pp == 1 ? std::min(k.first_params, k.last_params) : 0);
  // Gradient reduction over the replicas, in the weights' dtype.
  const double grad_bytes = stage_params * wbytes;
  const double last_backward = worst.bi + worst.bw;
  if (l.zero == 3) {
    // Per micro-batch: gather the weights for forward and for backward, reduce-scatter the
    // gradients; prefetched behind the micro-batch's compute.
    const double per_micro = 2 * allgather_seconds(stage_params * wbytes, replicas, dp_link) +
                             allgather_seconds(grad_bytes, replicas, dp_link);
    const double first_unit = allgather_seconds(block_p * wbytes, replicas, dp_link);
    p.parts.data_parallel = M * std::max(0.0, per_micro - (worst.f + last_backward)) + first_unit;
  } else if (replicas > 1) {
    // Layer offload's streamed gradients are host tensors: the partner CPU communicator (MPI)
    // reduces them, through host memory inside a node (at most the rank's share of the node's
    // bandwidth) and over the network between nodes; the rest goes over the device's link.
    const double host_grad_bytes = streamed * wbytes;
    Link host_link = dp_link;
    if (dp_in_node) host_link.bytes_per_s = std::min(c.intra.bytes_per_s, host_bw);
    const double comm = allreduce_seconds(grad_bytes - host_grad_bytes, replicas, dp_link) +
                        (host_grad_bytes > 0 ? allreduce_seconds(host_grad_bytes, replicas, host_link) : 0.0);
    const double bucket = allreduce_seconds(std::min(grad_bytes, 25.0 * (1 << 20)), replicas, dp_link);
    p.parts.data_parallel = std::max(comm - last_backward, bucket);
  }
  // The optimizer: the rank's share of the update.
  const double shard = l.zero >= 1 ? replicas : 1;
  const double updated = stage_params / shard;
  double host_update = 0;           // seconds of the update on the host
  double upload_beyond_update = 0;  // the new weights' copy to the device past the update's end
  if (l.offload_optimizer) {
    // The offloaded state is split over the replicas. With layer offload (--offload=all) it
    // covers the parameters on the device, and every rank updates the streamed blocks (already
    // on the host: nothing of theirs crosses PCIe for the update) with an optimizer of their own.
    const double on_device = stage_params - streamed;
    const double updated_here = on_device / replicas;
    host_update = (updated_here + streamed) * 28 / host_bw;
    // The gradients down and the updated weights up, in the weights' dtype (bf16 weights:
    // ZeRO-Offload's layout). The gradients stream to the host bucket by bucket during the last
    // micro-batch's backward (ZeRO-3's shard is copied after it); the CPU updates in chunks,
    // each chunk's new weights going up while the next one updates; with more replicas the
    // device part's new weights are then all-gathered over them.
    const double copy = updated_here * wbytes / c.pcie_bytes_per_s;  // each way
    upload_beyond_update = std::max(0.0, copy - host_update);
    p.parts.offload += (l.zero == 3 ? copy : std::max(0.0, copy - last_backward)) + upload_beyond_update +
                       (l.zero == 3 ? 0.0 : allgather_seconds(on_device * wbytes, replicas, dp_link));
  } else {
    // Layer offload: the streamed blocks are updated on the host (their weights live there),
    // after backward; the rest on the device.
    p.parts.optimizer = share * c.compute_scale * streaming_seconds(d, (updated - streamed / shard) * 28, 4);
    host_update = streamed * 28 / host_bw;
  }
  // The delayed update runs the host's part beside the next step's forward and backward; a CPU
  // device's compute and update share its cores, so nothing hides there.
  const double hidden = l.delayed_update && d.cores == 0 ? std::min(host_update + upload_beyond_update, pipeline) : 0.0;
  const double hidden_update = std::min(hidden, host_update);
  p.parts.optimizer += host_update - hidden_update;
  p.parts.offload -= hidden - hidden_update;  // the weights' upload past the update, hidden as well
  p.step_s = pipeline + p.parts.data_parallel + p.parts.optimizer + p.parts.offload + p.parts.overhead;
  const double tokens = static_cast<double>(l.global_batch_rows()) * k.tokens_per_row;
  p.tokens_per_s = tokens / p.step_s;
  p.tokens_per_s_per_gpu = p.tokens_per_s / l.ranks();
  p.mfu = k.flops_per_token * p.tokens_per_s / (l.ranks() * (l.bf16 ? d.peak_flops : d.fp32_flops));

  // ---- memory ----
  // fp32 weights, gradients and two moments; with bf16 weights the float32 master joins the state.
  // Layer offload: the streamed blocks live on the host, two of them on the device at a time
  // (the one in use and the next); the rest is resident, split as ZeRO splits it.
  const double resident = stage_params - streamed;
  double weights = resident * wbytes, grads = resident * wbytes, state = resident * (l.param_bf16 ? 12 : 8);
  if (l.zero >= 1) state /= replicas;
  if (l.zero >= 2 && M == 1) grads /= replicas;
  if (l.zero >= 3) weights = weights / replicas + 2 * block_p * wbytes;
  double host = 0;
  if (l.offload_optimizer) {
    // fp32 master, moments, the gradients' host copy (of the parameters on the device, with
    // layer offload: the streamed blocks' state is their own optimizer's, below).
    host += (stage_params - streamed) / replicas * (12 + wbytes);
    state = 0;
    if (l.delayed_update) {
      // The update's new weights, published next step (on the device), and the gradient buffer
      // the next backward fills while the update reads the other (on the host).
      state += (stage_params - streamed) / replicas * wbytes;
      host += (stage_params - streamed) / replicas * wbytes;
    }
  }
  if (l.offload_layers) {
    // The streamed blocks' weights and gradients on the host, two blocks on the device (the one
    // in use and the next), and their own optimizer's state there too: float32 moments, and
    // with bf16 weights a float32 master besides.
    host += streamed * 2 * wbytes;
    weights += 2 * block_p * wbytes;
    grads += 2 * block_p * wbytes;
    // Delayed, it is an OffloadedOptimizer (float32 master and moments) with a second page-locked
    // weight buffer for the update to write and the gradients it took held while the next
    // backward makes new ones.
    const double blocks_state = streamed * (l.param_bf16 || l.delayed_update ? 12 : 8);
    if (l.delayed_update) host += streamed * 2 * wbytes;
    host += blocks_state;
  }
  // A recomputed block keeps its input; the others what they keep for backward. With every
  // block recomputed the peak is one block's recompute on top of the inputs; with only the
  // first ones, it is the start of backward (their recompute comes after the others' are freed).
  const double Rm = recomputed_blocks(L);
  const double stage_act = Rm * k.block_input_bytes + (L - Rm) * k.block_held_bytes + (Rm >= L ? k.block_held_bytes : 0);
  // Interleaved: in_flight counts (micro-batch, chunk) pairs, each 1/chunks of the stage.
  double held = stage_act * std::max(1, in_flight) / l.chunks;
  // zb: a micro-batch between its B and its W also keeps its boundary operations' gradients
  // (counted for every micro-batch in flight: an upper bound; the first stage keeps none).
  if (l.pp > 1 && l.schedule == PipelineSchedule::kZeroBubble) held += std::max(1, in_flight) * L * k.block_capture_bytes;
  const double allocated = weights + grads + state + held + k.ends_held_bytes + k.autocast_copy_bytes;
  p.device_bytes = static_cast<int64_t>(allocated * 1.05 + d.context_bytes);
  p.host_bytes = static_cast<int64_t>(host * ranks_per_node);
  if (static_cast<double>(p.device_bytes) > d.memory_bytes) {
    p.fits = false;
    p.why_not = "needs " + fmt("%.1f", static_cast<double>(p.device_bytes) / kGiB) + " GiB per rank; the device has " +
                fmt("%.1f", d.memory_bytes / kGiB) + " GiB";
  } else if (static_cast<double>(p.host_bytes) > c.host_memory_bytes) {
    p.fits = false;
    p.why_not = "offload needs " + fmt("%.1f", static_cast<double>(p.host_bytes) / kGiB) +
                " GiB of host memory per node; the node has " + fmt("%.1f", c.host_memory_bytes / kGiB) + " GiB";
  }
  return p;
}

}  // namespace

Prediction simulate(const ModelShape& m, const Cluster& c, const Layout& l) {
  validate(m, c, l);
  return price(roofline_costs(m, c, l), c, l);
}

std::string Prediction::flags() const {
  std::string f = layout.flags();
  if (layout.pp > 1 && layout.schedule == PipelineSchedule::kZeroBubble) f += " --pp_zb_costs=" + pipeline_costs_text(zb_costs);
  return f;
}

std::string Prediction::to_string() const {
  std::ostringstream s;
  s << layout.to_string() << ": " << fmt("%.1f", step_s * 1e3) << " ms/step, " << fmt("%.0f", tokens_per_s_per_gpu)
    << " tokens/s per GPU, MFU " << fmt("%.1f", 100 * mfu) << "%, " << fmt("%.1f", static_cast<double>(device_bytes) / kGiB)
    << " GiB per rank";
  if (host_bytes > 0) s << ", host " << fmt("%.1f", static_cast<double>(host_bytes) / kGiB) << " GiB per node";
  if (!fits) s << " (does not fit: " << why_not << ")";
  return s.str();
}

std::string Prediction::to_json() const {
  nlohmann::json j;
  j["layout"] = layout.to_string();
  j["flags"] = flags();
  j["fits"] = fits;
  if (!fits) j["why_not"] = why_not;
  j["step_s"] = step_s;
  j["tokens_per_s"] = tokens_per_s;
  j["tokens_per_s_per_gpu"] = tokens_per_s_per_gpu;
  j["mfu"] = mfu;
  j["device_bytes"] = device_bytes;
  j["host_bytes"] = host_bytes;
  j["parts"] = {{"compute", parts.compute},           {"tensor_parallel", parts.tensor_parallel},
                {"context_parallel", parts.context_parallel}, {"pipeline_bubble", parts.pipeline_bubble},
                {"data_parallel", parts.data_parallel}, {"optimizer", parts.optimizer},
                {"offload", parts.offload},           {"overhead", parts.overhead}};
  return j.dump();
}

// ---- the search -----------------------------------------------------------------------------

namespace {

// The meshes of the cluster's ranks (dp x tp x pp x cp, tp and cp only when `split_blocks`)
// with each micro-batch size that divides a replica's rows: layouts with no technique yet.
std::vector<Layout> mesh_layouts(int64_t layers, bool split_blocks, const Cluster& c, const SearchOptions& o) {
  const int N = c.ranks();
  std::vector<Layout> out;
  for (int tp = 1; tp <= (split_blocks ? c.gpus_per_node : 1); tp *= 2) {
    for (int pp = 1; pp <= N / tp && pp <= layers; ++pp) {
      if ((N / tp) % pp != 0) continue;
      for (int cp = 1; cp <= N / (tp * pp); cp *= 2) {
        if (cp > 1 && (!o.allow_context_parallel || !split_blocks)) break;
        if ((N / (tp * pp)) % cp != 0) continue;
        const int dp = N / (tp * pp * cp);
        if (o.global_batch_rows % dp != 0) continue;
        const int64_t rows = o.global_batch_rows / dp;
        for (int64_t mb = 1; mb <= std::min(rows, o.max_micro_batch_rows); ++mb) {
          if (rows % mb != 0) continue;
          Layout l;
          l.dp = dp, l.tp = tp, l.pp = pp, l.cp = cp;
          l.bf16 = o.bf16;
          l.micro_batch_rows = mb;
          l.accum_steps = static_cast<int>(rows / mb);
          out.push_back(l);
        }
      }
    }
  }
  return out;
}

// The techniques tried on one mesh: pipeline schedule, ZeRO stage, offload, checkpointing,
// sequence parallelism, bf16 weights and the delayed update, each combination dtrain can run.
std::vector<Layout> technique_layouts(const Layout& mesh, const Cluster& c, const SearchOptions& o) {
  std::vector<std::pair<PipelineSchedule, int>> schedules = {{PipelineSchedule::k1F1B, 1}};
  if (mesh.pp > 1) {
    schedules.push_back({PipelineSchedule::kZeroBubble, 1});
    schedules.push_back({PipelineSchedule::kInterleaved, 2});
  }
  // offload: bit 0 the optimizer, bit 1 the layers (3: --offload=all). A CPU "device"
  // (Device::cores) is the host: offload moves nothing off it, so the search leaves it out
  // there (simulate() still prices such a layout).
  const int offloads = o.allow_offload && c.device.cores == 0 ? 3 : 0;
  std::vector<Layout> out;
  for (auto [schedule, chunks] : schedules) {
    for (int zero = 0; zero <= 3; ++zero) {
      for (int offload = 0; offload <= offloads; ++offload) {
        for (int ckpt = 0; ckpt <= 1; ++ckpt) {
          if ((offload & 2) && ckpt == 1) continue;  // layer offload recomputes its blocks: the same step
          for (int sp = 0; sp <= (mesh.tp > 1 ? 1 : 0); ++sp) {
            for (int pb = 0; pb <= (o.param_bf16 ? 1 : 0); ++pb) {
              for (int delayed = 0; delayed <= (offload != 0 ? 1 : 0); ++delayed) {
                Layout l = mesh;
                l.schedule = schedule;
                l.chunks = chunks;
                l.zero = zero;
                l.offload_optimizer = (offload & 1) != 0;
                l.offload_layers = (offload & 2) != 0;
                l.checkpoint = ckpt == 1;
                l.sequence_parallel = sp == 1;
                l.param_bf16 = pb == 1;
                l.delayed_update = delayed == 1;
                if (dtrain_limitation(l).empty()) out.push_back(l);
              }
            }
          }
        }
      }
    }
  }
  return out;
}

using Pricer = std::function<std::optional<Prediction>(const Layout&)>;

// `l` (which checkpoints every block and fits) with the fewest first blocks of each stage
// recomputed that fit, when that is fewer than all (nullopt: none fewer fit). `none` is `l`
// without checkpointing, which does not fit. A block recomputed keeps its input instead of its
// activations: the device's bytes fall by the same amount with each, so one block's price gives
// the count, and a price or two checks it (instead of a bisection of the blocks).
std::optional<Prediction> fewest_recomputed(const Layout& l, const Prediction& none, int max_blocks, double device_bytes,
                                            const Pricer& priced) {
  Layout partial = l;
  partial.checkpoint_blocks = 1;
  std::optional<Prediction> p = priced(partial);
  if (!p || p->fits) return p;
  const double per_block = static_cast<double>(none.device_bytes - p->device_bytes);
  if (per_block <= 0) return std::nullopt;
  const double over = static_cast<double>(p->device_bytes) - device_bytes;
  for (int k = std::max(2, 1 + static_cast<int>(std::ceil(over / per_block))); k <= max_blocks; ++k) {
    partial.checkpoint_blocks = k;
    p = priced(partial);
    if (p && p->fits) return p;
  }
  return std::nullopt;
}

// Every layout of the cluster's ranks for a model of `layers` blocks that `priced` validates
// and prices (nullopt: not valid) and that fits, fastest first (the simpler of two equal ones).
std::vector<Prediction> search_layouts(int64_t layers, bool split_blocks, const Cluster& c, const SearchOptions& o,
                                       const Pricer& priced) {
  DTRAIN_CHECK(o.global_batch_rows >= 1, "the search needs the global batch (sequences per step), >= 1");
  DTRAIN_CHECK(o.max_micro_batch_rows >= 1, "max_micro_batch_rows must be >= 1");
  auto complexity = [](const Layout& l) {
    return (l.tp > 1) + (l.pp > 1) + (l.cp > 1) + l.zero + l.offload_optimizer + l.offload_layers + l.checkpoint +
           (l.chunks > 1) + l.sequence_parallel + l.param_bf16 + l.delayed_update;
  };
  std::vector<Prediction> out;
  for (const Layout& mesh : mesh_layouts(layers, split_blocks, c, o)) {
    const std::vector<Layout> layouts = technique_layouts(mesh, c, o);
    std::vector<std::optional<Prediction>> prices;
    std::map<std::string, size_t> index;  // an uncheckpointed layout's text -> its price
    for (const Layout& l : layouts) {
      if (!l.checkpoint) index[l.to_string()] = prices.size();
      prices.push_back(priced(l));
    }
    for (size_t i = 0; i < layouts.size(); ++i) {
      std::optional<Prediction>& p = prices[i];
      if (!p || !p->fits) continue;
      const Layout& l = layouts[i];
      if (l.checkpoint && l.checkpoint_blocks < 0) {
        // Checkpointing every block fits. When the layout without it does not (it is faster than
        // recomputing any block, and among these), recompute only as many blocks as it takes.
        Layout twin = l;
        twin.checkpoint = false;
        auto it = index.find(twin.to_string());
        const std::optional<Prediction> none = it != index.end() ? prices[it->second] : priced(twin);
        if (none && !none->fits) {
          std::optional<Prediction> fewer =
              fewest_recomputed(l, *none, static_cast<int>(layers / l.pp) - 1, c.device.memory_bytes, priced);
          if (fewer) {
            out.push_back(std::move(*fewer));
            continue;
          }
        }
      }
      out.push_back(*p);
    }
  }
  std::stable_sort(out.begin(), out.end(), [&](const Prediction& a, const Prediction& b) {
    if (std::abs(a.step_s - b.step_s) > 1e-9 * std::max(a.step_s, b.step_s)) return a.step_s < b.step_s;
    return complexity(a.layout) < complexity(b.layout);
  });
  return out;
}

template <class Model>
std::optional<Prediction> priced_if_valid(const Model& m, const Cluster& c, const Layout& l) {
  try {
    return simulate(m, c, l);
  } catch (const dtrain::Error&) {
    return std::nullopt;
  }
}

}  // namespace

std::vector<Prediction> search(const ModelShape& m, const Cluster& c, const SearchOptions& o) {
  return search_layouts(m.layers, true, c, o, [&](const Layout& l) -> std::optional<Prediction> {
    if (!dtrain_limitation(l, m.tie_embeddings).empty()) return std::nullopt;
    return priced_if_valid(m, c, l);
  });
}

std::vector<Prediction> search(const MeasuredModel& m, const Cluster& c, const SearchOptions& o) {
  return search_layouts(m.blocks, false, c, o, [&](const Layout& l) { return priced_if_valid(m, c, l); });
}

// ---- measured models ------------------------------------------------------------------------

Line Line::through(double r0, double y0, double r1, double y1) {
  DTRAIN_CHECK(r1 > r0, "a line needs two different row counts (", r0, ", ", r1, ")");
  Line l;
  l.per_row = std::max(0.0, (y1 - y0) / (r1 - r0));
  l.intercept = y0 - l.per_row * r0;
  return l;
}

std::string MeasuredModel::to_string() const {
  std::ostringstream s;
  s << name << " (measured): " << blocks << " blocks of " << fmt("%.2f", static_cast<double>(block_parameters) / 1e6)
    << "M parameters, " << fmt("%.2f", static_cast<double>(pre_parameters + post_parameters) / 1e6)
    << "M before and after; a block " << fmt("%.3f", 1e3 * block_forward.per_row) << " + "
    << fmt("%.3f", 1e3 * block_backward.per_row) << " ms per row forward + backward";
  return s.str();
}

namespace {
nlohmann::json line_json(const Line& l) { return {{"intercept_s", l.intercept}, {"per_row_s", l.per_row}}; }
}  // namespace

std::string MeasuredModel::to_json() const {
  nlohmann::json j;
  j["name"] = name;
  if (!shape.empty()) j["shape"] = shape;
  if (!device.empty()) j["device"] = device;
  j["blocks"] = blocks;
  j["block_parameters"] = block_parameters;
  j["pre_parameters"] = pre_parameters;
  j["post_parameters"] = post_parameters;
  j["tokens_per_row"] = tokens_per_row;
  j["flops_per_row"] = flops_per_row;
  j["block_forward"] = line_json(block_forward);
  j["block_backward"] = line_json(block_backward);
  j["pre_forward"] = line_json(pre_forward);
  j["pre_backward"] = line_json(pre_backward);
  j["post_forward"] = line_json(post_forward);
  j["post_backward"] = line_json(post_backward);
  j["activation_bytes_per_row"] = activation_bytes_per_row;
  j["block_held_bytes_per_row"] = block_held_bytes_per_row;
  j["post_held_bytes_per_row"] = post_held_bytes_per_row;
  return j.dump(2);
}

MeasuredModel measured_model_from_json(const std::string& json_text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    DTRAIN_CHECK(false, "the measured model file is not JSON (", e.what(), "); write it with measure_model()");
  }
  auto num = [&](const nlohmann::json& o, const char* key, bool signed_ok = false) {
    DTRAIN_CHECK(o.contains(key) && o[key].is_number() && std::isfinite(o[key].get<double>()) &&
                     (signed_ok || o[key].get<double>() >= 0),
                 "the measured model file's \"", key, "\" must be a number", signed_ok ? "" : " >= 0");
    return o[key].get<double>();
  };
  auto line = [&](const char* key) {
    DTRAIN_CHECK(j.contains(key) && j[key].is_object(), "the measured model file lacks \"", key, "\"");
    Line l;
    l.intercept = num(j[key], "intercept_s", true);
    l.per_row = num(j[key], "per_row_s");
    return l;
  };
  MeasuredModel m;
  if (j.contains("name") && j["name"].is_string()) m.name = j["name"].get<std::string>();
  if (j.contains("shape") && j["shape"].is_string()) m.shape = j["shape"].get<std::string>();
  if (j.contains("device") && j["device"].is_string()) m.device = j["device"].get<std::string>();
  m.blocks = static_cast<int64_t>(num(j, "blocks"));
  DTRAIN_CHECK(m.blocks >= 1, "the measured model file's \"blocks\" must be >= 1");
  m.block_parameters = static_cast<int64_t>(num(j, "block_parameters"));
  m.pre_parameters = static_cast<int64_t>(num(j, "pre_parameters"));
  m.post_parameters = static_cast<int64_t>(num(j, "post_parameters"));
  m.tokens_per_row = num(j, "tokens_per_row");
  m.flops_per_row = num(j, "flops_per_row");
  m.block_forward = line("block_forward");
  m.block_backward = line("block_backward");
  m.pre_forward = line("pre_forward");
  m.pre_backward = line("pre_backward");
  m.post_forward = line("post_forward");
  m.post_backward = line("post_backward");
  m.activation_bytes_per_row = num(j, "activation_bytes_per_row");
  m.block_held_bytes_per_row = num(j, "block_held_bytes_per_row");
  m.post_held_bytes_per_row = num(j, "post_held_bytes_per_row");
  return m;
}

Prediction simulate(const MeasuredModel& m, const Cluster& c, const Layout& l) {
  DTRAIN_CHECK(m.blocks >= 1, "a measured model needs its blocks (", m.blocks, ")");
  validate_layout(m.blocks, c, l);
  DTRAIN_CHECK(l.tp == 1 && l.cp == 1, "a measured model (", m.name, ") is priced without tensor and context ",
               "parallelism (its blocks' split is the model's own); layout ", l.to_string());
  const double r = static_cast<double>(l.micro_batch_rows);
  StepCosts k;
  k.layers = m.blocks;
  k.block.forward = m.block_forward.at(r);
  k.block.backward_input = k.block.backward_weight = m.block_backward.at(r) / 2;
  k.first_f = m.pre_forward.at(r), k.first_b = m.pre_backward.at(r);
  k.last_f = m.post_forward.at(r), k.last_b = m.post_backward.at(r);
  k.act_bytes = m.activation_bytes_per_row * r;
  k.block_params = static_cast<double>(m.block_parameters);
  k.first_params = static_cast<double>(m.pre_parameters);
  k.last_params = static_cast<double>(m.post_parameters);
  k.block_held_bytes = m.block_held_bytes_per_row * r;
  k.block_input_bytes = m.activation_bytes_per_row * r;
  k.ends_held_bytes = m.post_held_bytes_per_row * r;
  k.tokens_per_row = m.tokens_per_row;
  k.flops_per_token = m.tokens_per_row > 0 ? m.flops_per_row / m.tokens_per_row : 0;
  Cluster measured = c;
  measured.compute_scale = 1;  // the times are the device's own
  measured.compute_scale_points.clear();
  return price(k, measured, l);
}

}  // namespace dtrain::engine::sim
