// dtrain-plan --simulate and --calibrate: the step-time simulator (engine/memory/simulator.h)
// on the command line.
//
//   dtrain-plan --simulate --model=llama --hf_config=llama3_8b.json --seq_len=8192
//       --nodes=16 --gpus_per_node=8 --gpu=h100 --batch_size=2 --shard=parameters --amp=bf16
//     the prediction of one layout: the usual flags (--tp --pp --cp --pp_schedule --pp_chunks
//     --batch_size (per data-parallel rank) --accum_steps --shard --offload
//     --checkpoint_activations --sequence_parallel --amp) on the cluster the flags describe
//     (data parallelism takes the ranks the others leave);
//   dtrain-plan --simulate --search --global_batch=1024 ...: every layout that fits, fastest
//     first (--top rows), and the best one's flags;
//   dtrain-plan --simulate --search --scaling_nodes=1,2,4,8 ...: the best layout's predicted
//     throughput at each node count (a table and JSON lines; tools/plot_scaling.py draws them);
//   dtrain-plan --model=gpt [shape flags] --calibrate=cluster.json (under mpirun with the ranks of
//     one node): measures this machine (matrix multiply and attention rates, memory bandwidth,
//     the shortest kernel, the all-reduce's latency and bandwidth over the run's ranks, the
//     model's own forward and backward, the trainer's step) and writes the cluster file that
//     --cluster=cluster.json reads.
#include <gflags/gflags.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <tuple>

#include "common.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/simulator.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/engine/train/measure_model.h"
#include "model_factory.h"
#include "plan_simulate.h"

DEFINE_bool(simulate, false, "predict the step time and memory of a layout on a cluster instead of probing this machine");
DEFINE_bool(search, false, "--simulate: rank every layout of the cluster that fits a global batch (--global_batch)");
DEFINE_int64(global_batch, 0, "--simulate --search: sequences per optimizer step (0: --batch_size x the cluster's ranks)");
DEFINE_int32(top, 10, "--simulate --search: layouts to print");
DEFINE_int32(nodes, 1, "--simulate: nodes in the cluster");
DEFINE_int32(gpus_per_node, 8, "--simulate: GPUs (ranks) per node");
DEFINE_string(gpu, "h100", "--simulate: device kind (h100, h200, a100, a100-40gb); not with --cluster, whose device is the calibrated one");
DEFINE_string(cluster, "", "--simulate: a cluster file written by --calibrate (device, links, overheads)");
DEFINE_double(intra_node_gbps, 0, "--simulate: collective bus bandwidth inside a node, GB/s per GPU (0: the device's default)");
DEFINE_double(inter_node_gbps, 0, "--simulate: collective bus bandwidth between nodes, GB/s per GPU (0: 45, or the cluster file's)");
DEFINE_double(inter_node_latency_us, -1, "--simulate: latency of one step of a collective between nodes (-1: default)");
DEFINE_string(scaling_nodes, "", "--simulate --search: node counts to predict the best layout at, e.g. 1,2,4,8");
DEFINE_string(calibrate, "", "measure this machine and write the cluster file --simulate --cluster reads");
DEFINE_string(measure, "", "time the model's own pieces through its ModelSpec and write the file --simulate --measured reads");
DEFINE_string(measured, "", "--simulate: price a model measured by --measure (or engine::measure_model) instead of the shape flags' roofline");

namespace dtrain::examples {

namespace sim = engine::sim;

namespace {

using Clock = std::chrono::steady_clock;

// Timing: engine::synchronize_device, median_seconds and median_of (measure_model.h), the rules
// the model measurement uses too.
using engine::median_seconds;

bool given(const char* flag) {
  gflags::CommandLineFlagInfo info;
  return gflags::GetCommandLineFlagInfo(flag, &info) && !info.is_default;
}

sim::Cluster cluster_from_flags(int nodes) {
  sim::Cluster c;
  c.device = sim::named_device(FLAGS_gpu);
  if (FLAGS_gpu.rfind("a100", 0) == 0) c.intra = {240e9, 3e-6};  // NVLink 3 (600 GB/s), NCCL's bus bandwidth
  if (!FLAGS_cluster.empty()) c = sim::cluster_from_json(read_text_file(FLAGS_cluster, "--cluster"), c);
  c.nodes = nodes;
  if (given("gpus_per_node") || FLAGS_cluster.empty()) c.gpus_per_node = FLAGS_gpus_per_node;
  if (FLAGS_intra_node_gbps > 0) c.intra.bytes_per_s = FLAGS_intra_node_gbps * 1e9;
  if (FLAGS_inter_node_gbps > 0) c.inter.bytes_per_s = FLAGS_inter_node_gbps * 1e9;
  if (FLAGS_inter_node_latency_us >= 0) c.inter.latency_s = FLAGS_inter_node_latency_us * 1e-6;
  // The run's budgets, as --plan=auto takes them: the process's device memory, the host's.
  const engine::cli::Flags& f = engine::cli::flags();
  if (f.gpu_mem_limit_gb > 0) c.device.memory_bytes = f.gpu_mem_limit_gb * (1 << 30);
  if (f.host_mem_limit_gb > 0) c.host_memory_bytes = f.host_mem_limit_gb * (1 << 30) * c.gpus_per_node;
  return c;
}

// Flags that would change nothing in this mode, or describe another model than the one priced:
// refused, naming what to do.
void check_simulate_flags(const std::string& model_name, const sim::MeasuredModel* measured) {
  DTRAIN_CHECK(FLAGS_intra_node_gbps >= 0 && FLAGS_inter_node_gbps >= 0, "--intra_node_gbps=", FLAGS_intra_node_gbps,
               " and --inter_node_gbps=", FLAGS_inter_node_gbps, " must be >= 0 (0: the default)");
  DTRAIN_CHECK(FLAGS_inter_node_latency_us >= 0 || FLAGS_inter_node_latency_us == -1, "--inter_node_latency_us=",
               FLAGS_inter_node_latency_us, " must be >= 0 (-1: the default)");
  DTRAIN_CHECK(!(given("gpu") && !FLAGS_cluster.empty()), "--gpu=", FLAGS_gpu, " with --cluster=", FLAGS_cluster,
               ": the cluster file's device is the one it calibrated (its rates and compute scale are that "
               "machine's); give one of them (a named GPU takes --intra_node_gbps / --inter_node_gbps for its links)");
  DTRAIN_CHECK(FLAGS_search || !given("global_batch"), "--global_batch is the search's (--search); one layout's batch "
               "is --batch_size sequences per data-parallel rank");
  DTRAIN_CHECK(!given("pp_zb_costs"), "--pp_zb_costs with --simulate: the simulator orders the zero-bubble lists at "
               "the costs it prices, and prints them as --pp_zb_costs in the layout's flags; drop it");
  if (FLAGS_search) {
    // The search chooses these itself: a given one would be dropped without a word.
    for (const char* flag : {"tp", "pp", "cp", "shard", "offload", "checkpoint_activations", "checkpoint_blocks",
                             "sequence_parallel", "accum_steps", "pp_schedule", "pp_chunks", "pp_blocks",
                             "offload_delayed_update_after"}) {
      DTRAIN_CHECK(!given(flag), "--", flag, " with --search: the search chooses the layout and its techniques "
                   "itself; drop --", flag, ", or price that one layout with --simulate alone");
    }
    const std::string amp = engine::cli::flags().amp;
    DTRAIN_CHECK(amp == "off" || amp == "bf16", "--simulate prices --amp=bf16 or off; --amp=", amp,
                 " (fp16) runs at bf16's speed: give --amp=bf16");
  }
  const char* const shape_flags[] = {"layers", "d_model", "heads", "kv_heads", "ff", "vocab", "seq_len",
                                     "tie_embeddings", "hf_config"};
  if (measured != nullptr) {
    DTRAIN_CHECK(!FLAGS_cluster.empty(), "--measured=", FLAGS_measured, ": its times are of the machine it was measured "
                 "on; give that machine's --cluster=FILE (dtrain-plan --calibrate there)");
    DTRAIN_CHECK(measured->device.empty() || FLAGS_cluster.empty() ||
                     sim::cluster_from_json(read_text_file(FLAGS_cluster, "--cluster")).device.name ==
                         "calibrated-" + measured->device,
                 "--measured=", FLAGS_measured, " was timed on the ", measured->device, " and --cluster=", FLAGS_cluster,
                 " is another device's calibration; give the cluster file of the machine that measured the model");
    bool shape_given = false;
    for (const char* flag : shape_flags) shape_given = shape_given || given(flag);
    if (shape_given) {
      const std::string flags_shape =
          model_name == "gpt" || model_name == "llama" ? simulator_shape(model_name).to_string() : std::string();
      DTRAIN_CHECK(!measured->shape.empty() && flags_shape == measured->shape, "--measured=", FLAGS_measured,
                   " is of ", measured->shape.empty() ? "a model of its own" : measured->shape,
                   ", and the shape flags describe ", flags_shape.empty() ? "another" : flags_shape,
                   ": the file gives the model; drop the shape flags, or --measure this shape");
    }
  }
}

// The layout the standard flags describe on `ranks` ranks.
sim::Layout layout_from_flags(int ranks) {
  const engine::cli::Flags& f = engine::cli::flags();
  const int model_ranks = f.tp * f.pp * f.cp;
  DTRAIN_CHECK(ranks % model_ranks == 0, "--tp=", f.tp, " x --pp=", f.pp, " x --cp=", f.cp, " = ", model_ranks,
               " does not divide the cluster's ", ranks, " ranks (--nodes x --gpus_per_node)");
  DTRAIN_CHECK(f.amp == "off" || f.amp == "bf16", "--simulate prices --amp=bf16 or off; --amp=", f.amp,
               " (fp16) runs at bf16's speed: give --amp=bf16");
  return simulator_layout(f.tp, f.pp, f.cp, ranks / model_ranks);
}

std::vector<int> parse_counts(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    DTRAIN_CHECK(!item.empty() && *end == '\0' && v >= 1 && v <= 1000000, "--scaling_nodes=", text,
                 ": \"", item, "\" is not a node count >= 1; give counts separated by commas, e.g. 1,2,4");
    out.push_back(static_cast<int>(v));
  }
  DTRAIN_CHECK(!out.empty(), "--scaling_nodes is empty; give node counts separated by commas, e.g. 1,2,4");
  return out;
}

}  // namespace

bool simulate_requested(int argc, char** argv) {
  bool on = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;
    if (a.rfind("--", 0) == 0) a = a.substr(1);  // gflags takes -flag and --flag
    if (a == "-simulate") on = true;
    if (a == "-nosimulate") on = false;
    if (a.rfind("-simulate=", 0) == 0) {
      const std::string v = a.substr(10);
      on = v == "true" || v == "1" || v == "yes" || v == "t" || v == "y";
    }
  }
  return on;
}

std::vector<std::string> simulate_flag_names() {
  return {"simulate",       "search",          "global_batch",          "top",       "nodes",
          "gpus_per_node",  "gpu",             "cluster",               "intra_node_gbps",
          "inter_node_gbps", "inter_node_latency_us", "scaling_nodes", "calibrate", "measure", "measured"};
}

int simulate_main(int argc, char** argv, const std::string& model_name) {
  engine::cli::parse(argc, argv,
                     "dtrain-plan --simulate --model=gpt|llama [shape flags] [layout flags] --nodes=N "
                     "--gpus_per_node=G --gpu=h100: predicted step time and memory",
                     engine::cli::kAllTopics, model_flag_defaults(model_name));
  apply_hf_config();
  DTRAIN_CHECK(FLAGS_nodes >= 1 && FLAGS_gpus_per_node >= 1, "--nodes=", FLAGS_nodes, " and --gpus_per_node=",
               FLAGS_gpus_per_node, " must be >= 1");
  DTRAIN_CHECK(FLAGS_global_batch >= 0, "--global_batch=", FLAGS_global_batch, " must be >= 0");
  DTRAIN_CHECK(FLAGS_top >= 1, "--top=", FLAGS_top, " must be >= 1");
  DTRAIN_CHECK(FLAGS_scaling_nodes.empty() || FLAGS_search, "--scaling_nodes needs --search");
  const bool measured = !FLAGS_measured.empty();
  const sim::MeasuredModel measured_model =
      measured ? sim::measured_model_from_json(read_text_file(FLAGS_measured, "--measured")) : sim::MeasuredModel{};
  check_simulate_flags(model_name, measured ? &measured_model : nullptr);
  const sim::ModelShape model = measured ? sim::ModelShape{} : simulator_shape(model_name);
  const sim::Cluster cluster = cluster_from_flags(FLAGS_nodes);
  if (!measured && !cluster.calibrated_model.empty() && cluster.calibrated_model != model.to_string()) {
    std::fprintf(stderr, "dtrain-plan: warning: --cluster=%s was calibrated on %s; this model (%s) takes its compute "
                 "scale as measured there, which can be far off for another shape (calibrate on this one)\n",
                 FLAGS_cluster.c_str(), cluster.calibrated_model.c_str(), model.to_string().c_str());
  }
  if (measured) {
    std::printf("model: %s\n", measured_model.to_string().c_str());
  } else {
    std::printf("model: %s, %.2f GFLOP per token (6N + 12 L d S)\n", model.to_string().c_str(),
                model.flops_per_token() / 1e9);
  }
  auto price = [&](const sim::Cluster& c, const sim::Layout& l) {
    return measured ? sim::simulate(measured_model, c, l) : sim::simulate(model, c, l);
  };
  auto rank = [&](const sim::Cluster& c, const sim::SearchOptions& so) {
    return measured ? sim::search(measured_model, c, so) : sim::search(model, c, so);
  };
  std::printf("cluster: %s\n", cluster.to_string().c_str());
  if (!FLAGS_search) {
    const sim::Layout layout = layout_from_flags(cluster.ranks());
    const sim::Prediction p = price(cluster, layout);
    std::printf("predicted: %s\n", p.to_string().c_str());
    const std::string limitation = sim::dtrain_limitation(layout, !measured && model.tie_embeddings);
    if (!limitation.empty())
      std::printf("note: dtrain does not run %s yet (the figures price the layout as other frameworks run it)\n",
                  limitation.c_str());
    const sim::StepParts& s = p.parts;
    std::printf("  compute %.1f ms, tensor-parallel %.1f, context-parallel %.1f, pipeline bubble %.1f, "
                "data-parallel %.1f, optimizer %.1f, offload %.1f, overhead %.1f\n",
                1e3 * s.compute, 1e3 * s.tensor_parallel, 1e3 * s.context_parallel, 1e3 * s.pipeline_bubble,
                1e3 * s.data_parallel, 1e3 * s.optimizer, 1e3 * s.offload, 1e3 * s.overhead);
    std::printf("%s\n", p.to_json().c_str());
    return p.fits ? 0 : 1;
  }
  sim::SearchOptions so;
  so.bf16 = engine::cli::flags().amp != "off";
  // bf16 weights are tried with AMP, unless --param_dtype=float32 is asked for.
  so.param_bf16 = so.bf16 && !(given("param_dtype") && engine::parse_param_dtype(engine::cli::flags().param_dtype) ==
                                                           at::kFloat);
  const std::vector<int> node_counts =
      FLAGS_scaling_nodes.empty() ? std::vector<int>{FLAGS_nodes} : parse_counts(FLAGS_scaling_nodes);
  int status = 0;
  for (int nodes : node_counts) {
    sim::Cluster c = cluster_from_flags(nodes);
    so.global_batch_rows = FLAGS_global_batch > 0 ? FLAGS_global_batch : engine::cli::flags().batch_size * c.ranks();
    const std::vector<sim::Prediction> ranked = rank(c, so);
    if (ranked.empty()) {
      std::printf("%d node%s: no layout of %d ranks fits a global batch of %lld sequences\n", nodes,
                  nodes > 1 ? "s" : "", c.ranks(), static_cast<long long>(so.global_batch_rows));
      status = 1;
      continue;
    }
    if (node_counts.size() == 1) {
      std::printf("%zu layouts fit a global batch of %lld sequences; the fastest:\n", ranked.size(),
                  static_cast<long long>(so.global_batch_rows));
      for (size_t i = 0; i < ranked.size() && i < static_cast<size_t>(FLAGS_top); ++i)
        std::printf("%2zu. %s\n", i + 1, ranked[i].to_string().c_str());
      std::printf("best: %s\n", ranked[0].flags().c_str());
    } else {
      std::printf("%d node%s (%d ranks): %s\n", nodes, nodes > 1 ? "s" : "", c.ranks(), ranked[0].to_string().c_str());
    }
    nlohmann::json j = nlohmann::json::parse(ranked[0].to_json());
    j["nodes"] = nodes;
    j["ranks"] = c.ranks();
    j["global_batch"] = so.global_batch_rows;
    j["layouts_that_fit"] = ranked.size();
    std::printf("%s\n", j.dump().c_str());
  }
  return status;
}

void calibrate(const Run& run, ExampleModel& m, const engine::TrainerOptions& options, const std::string& path) {
  DTRAIN_CHECK(m.name == "gpt" || m.name == "llama", "--calibrate times the language models (--model=gpt or llama)");
  DTRAIN_CHECK(run.mesh->tp_size() == 1 && run.mesh->pp_size() == 1 && run.mesh->cp_size() == 1,
               "--calibrate times the whole model on each rank: run it without --tp, --pp and --cp (with the ranks "
               "of one node under mpirun, for the links)");
  const engine::cli::Flags& f = engine::cli::flags();
  const c10::Device dev = run.device;
  const bool bf16 = f.amp == "bf16" && dev.is_cuda();
  const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  const auto opts = torch::TensorOptions().device(dev).dtype(dtype);
  const sim::ModelShape shape = simulator_shape(m.name);
  const int64_t rows = f.batch_size / f.accum_steps;
  const int64_t t = rows * shape.seq_len;
  sim::Cluster c;
  DTRAIN_CHECK(run.world.size % run.world.local_size == 0, "--calibrate needs the same number of ranks on every "
               "node (", run.world.size, " ranks, ", run.world.local_size, " on this one)");
  c.nodes = run.world.size / run.world.local_size;
  c.gpus_per_node = run.world.local_size;
  c.device.name = dev.is_cuda() ? "calibrated-cuda" : "calibrated-cpu";
  c.calibrated_model = shape.to_string();
  {  // the matrix multiply: the fastest rate among the model's shapes (the peak MFU is taken against)
    double best = 0;
    // (rows, inner, columns): the MLP's two, the attention's projection, the head (at most 2048 rows:
    // its output is rows x vocab)
    for (auto [r, k, n] : {std::tuple<int64_t, int64_t, int64_t>{t, shape.d_model, shape.ff}, {t, shape.ff, shape.d_model},
                           {t, shape.d_model, shape.d_model}, {std::min<int64_t>(t, 2048), shape.d_model, shape.vocab}}) {
      torch::Tensor a = torch::randn({r, k}, opts), b = torch::randn({k, n}, opts);
      const double s = median_seconds(dev, 5, [&] { (void)torch::mm(a, b); });
      best = std::max(best, 2.0 * r * k * n / s);
    }
    c.device.peak_flops = c.device.fp32_flops = best;
    c.device.matmul_efficiency = 1;
  }
  {  // streaming: c = a + b over 3 x 64 MiB
    const int64_t n = int64_t{16} << 20;
    torch::Tensor a = torch::randn({n}, opts.dtype(torch::kFloat32)), b = torch::randn_like(a), out = torch::empty_like(a);
    const double s = median_seconds(dev, 5, [&] { torch::add_out(out, a, b); });
    c.device.memory_bytes_per_s = 3.0 * n * 4 / s;
    c.device.memory_efficiency = 1;
    torch::Tensor x = torch::ones({1}, opts), y = torch::empty_like(x);
    c.device.kernel_seconds = median_seconds(dev, 201, [&] { torch::add_out(y, x, x); });
  }
  {  // causal attention of one micro-batch, forward
    const int64_t hd = shape.d_model / shape.heads;
    torch::Tensor q = torch::randn({rows, shape.heads, shape.seq_len, hd}, opts), k = torch::randn_like(q),
                  v = torch::randn_like(q);
    const double s = median_seconds(dev, 3, [&] {
      (void)at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    });
    c.device.attention_efficiency =
        std::min(1.0, 2.0 * t * shape.seq_len * shape.d_model / (s * c.device.peak_flops));
  }
  if (dev.is_cpu()) {
    c.device.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()) /
                                      std::max(1, at::get_num_threads()));
    c.device.context_bytes = 0;
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    c.device.memory_bytes = static_cast<double>(pages) * page / std::max(1, run.world.local_size);
    c.pcie_bytes_per_s = c.device.memory_bytes_per_s;
    // The host is the device: its bandwidth for an offloaded update is the cores' together.
    c.host_bytes_per_s = c.device.memory_bytes_per_s * c.device.cores;
    c.host_memory_bytes = static_cast<double>(pages) * page;
  }
  // The all-reduce over the run's ranks: a least-squares line of time against the ring's bytes
  // term 2 (n-1)/n S over sizes from 4 KiB to 16 MiB.
  const int n = run.world.size;
  if (n > 1) {
    std::vector<double> xs, ys;
    for (int64_t bytes = 4096; bytes <= (int64_t{16} << 20); bytes *= 4) {
      torch::Tensor buf = torch::ones({bytes / 4}, opts.dtype(torch::kFloat32));
      const double s = median_seconds(dev, 7, [&] { run.comm->all_reduce(buf)->wait(); });
      std::vector<double> all = {s};
      // The slowest rank's time: every rank uses the same figures.
      torch::Tensor st = torch::tensor(all, torch::TensorOptions().dtype(torch::kFloat64)).to(dev);
      run.comm->all_reduce(st, dist::ReduceOp::kMax)->wait();
      xs.push_back(2.0 * (n - 1) / n * static_cast<double>(bytes));
      ys.push_back(st.cpu().item<double>());
    }
    double mx = 0, my = 0;
    for (size_t i = 0; i < xs.size(); ++i) mx += xs[i] / xs.size(), my += ys[i] / ys.size();
    double sxy = 0, sxx = 0;
    for (size_t i = 0; i < xs.size(); ++i) sxy += (xs[i] - mx) * (ys[i] - my), sxx += (xs[i] - mx) * (xs[i] - mx);
    const double slope = std::max(1e-15, sxy / sxx), intercept = std::max(0.0, my - slope * mx);
    sim::Link link{1.0 / slope, intercept / (2.0 * (n - 1))};
    // Ranks on one node measure the link inside it (the one between nodes stays the default or
    // --inter_node_gbps); ranks on several, the link between them.
    (run.world.local_size == n ? c.intra : c.inter) = link;
  }
  // The model's own forward and backward at the micro-batch, against the roofline's figure.
  sim::Layout one;
  one.dp = 1;
  one.micro_batch_rows = rows;
  one.bf16 = f.amp == "bf16";
  one.checkpoint = f.checkpoint_activations;
  one.checkpoint_blocks = f.checkpoint_blocks;  // -1 unless checkpointing (the flags' validation)
  sim::Cluster single = c;
  single.nodes = 1;
  single.gpus_per_node = 1;
  checkpoint_as_flags(m);
  // At the micro-batch and at a quarter of it (caches make small ones faster per token on a CPU).
  double fb = 0, fb_predicted = 0;
  for (int64_t r : {std::max<int64_t>(1, rows / 4), rows}) {
    engine::Batch batch = m.synthetic_batch(r);
    const double s = median_seconds(dev, 5, [&] {
      at::Tensor loss;
      {
        engine::AutocastGuard autocast(dev.type(), engine::parse_amp(f.amp));
        loss = m.loss(batch);
      }
      loss.backward();
    });
    one.micro_batch_rows = r;
    const double predicted = sim::simulate(shape, single, one).parts.compute;
    if (c.compute_scale_points.empty() || r * shape.seq_len > c.compute_scale_points.back().first)
      c.compute_scale_points.emplace_back(static_cast<double>(r * shape.seq_len), s / predicted);
    fb = s, fb_predicted = predicted;
  }
  for (auto& p : m.module->parameters()) p.mutable_grad() = at::Tensor();
  c.compute_scale = c.compute_scale_points.back().second;
  // The trainer's step of the flags' technique against the prediction: the rest is overhead.
  engine::TrainerOptions o = options;
  // Two warm-up steps, then the median of nine (five varied by a fifth between runs on a
  // shared CPU).
  constexpr int kWarmup = 2, kTimed = 9;
  o.steps = kWarmup + kTimed;
  o.progress = false;
  o.metrics_path.clear();
  o.tensorboard_dir.clear();
  o.timeline_path.clear();
  o.save_dir.clear();
  o.memory_report_step = 0;
  std::unique_ptr<engine::Trainer> trainer = make_trainer(run, m, o);
  engine::Batch full = m.synthetic_batch(f.batch_size);
  std::vector<double> steps;
  for (int s = 0; s < kWarmup + kTimed; ++s) {
    engine::synchronize_device(dev);
    const auto t0 = Clock::now();
    trainer->step(full);
    engine::synchronize_device(dev);
    if (s >= kWarmup) steps.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  sim::Layout layout;
  layout.dp = n;
  layout.micro_batch_rows = rows;
  layout.accum_steps = f.accum_steps;
  layout.bf16 = one.bf16;
  layout.checkpoint = one.checkpoint;
  layout.checkpoint_blocks = one.checkpoint_blocks;
  const sim::Prediction before = sim::simulate(shape, c, layout);
  const double measured = engine::median_of(steps);
  c.step_overhead_s = std::max(0.0, measured - before.step_s);
  const double fastest = *std::min_element(steps.begin(), steps.end()),
               slowest = *std::max_element(steps.begin(), steps.end());
  if (run.world.rank != 0) return;
  // A machine whose load changed while it was timed gives figures of neither state.
  if (slowest > 1.25 * fastest || c.step_overhead_s > 0.5 * measured) {
    std::fprintf(stderr, "dtrain-plan: warning: --calibrate's %d trainer steps took %.1f to %.1f ms (median %.1f, of "
                 "which %.1f ms is not the model's forward and backward): the machine was %s; its predictions can be "
                 "far off. Calibrate again on a quiet machine\n",
                 kTimed, 1e3 * fastest, 1e3 * slowest, 1e3 * measured, 1e3 * c.step_overhead_s,
                 slowest > 1.25 * fastest ? "busy with other work while it was timed" : "slower than its own parts add up to");
  }
  if (c.compute_scale < 0.8) {
    std::fprintf(stderr, "dtrain-plan: warning: the model's forward and backward ran at %.2f of the time its matrix "
                 "multiplies at the measured rate would take: the rate was measured low (a busy machine?); MFU "
                 "figures from this file can exceed 100%%. Calibrate again on a quiet machine\n", c.compute_scale);
  }
  std::ofstream out(path);
  DTRAIN_CHECK(out.good(), "--calibrate=", path, " cannot be written; give a writable path");
  out << c.to_json() << "\n";
  out.close();
  DTRAIN_CHECK(out.good(), "--calibrate=", path, ": writing failed (disk full?)");
  std::printf("calibrate: matrix multiply %.1f GFLOP/s, attention %.0f%% of it, memory %.1f GB/s, kernel %.1f us\n",
              c.device.peak_flops / 1e9, 100 * c.device.attention_efficiency, c.device.memory_bytes_per_s / 1e9,
              1e6 * c.device.kernel_seconds);
  if (n > 1) {
    const sim::Link& l = run.world.local_size == n ? c.intra : c.inter;
    std::printf("calibrate: all-reduce over %d ranks on %d node(s): %.2f GB/s bus bandwidth, %.1f us per step\n", n,
                c.nodes, l.bytes_per_s / 1e9, 1e6 * l.latency_s);
  }
  std::printf("calibrate: model forward+backward %.1f ms (roofline %.1f ms: scale %.2f); trainer step %.1f ms, "
              "overhead %.1f ms\n",
              1e3 * fb, 1e3 * fb_predicted, c.compute_scale, 1e3 * measured, 1e3 * c.step_overhead_s);
  if (c.compute_scale_points.size() > 1)
    std::printf("calibrate: at %.0f tokens per micro-batch the scale is %.2f\n", c.compute_scale_points[0].first,
                c.compute_scale_points[0].second);
  std::printf("calibrate: wrote %s\n", path.c_str());
}

void measure(const Run& run, ExampleModel& m, const std::string& path) {
  DTRAIN_CHECK(m.spec.has_value(), "--measure times a model through its ModelSpec; --model=", m.name, " has none ",
               "(gpt and llama do)");
  DTRAIN_CHECK(run.mesh->tp_size() == 1 && run.mesh->pp_size() == 1 && run.mesh->cp_size() == 1,
               "--measure times the whole model on each rank: run it without --tp, --pp and --cp");
  const engine::cli::Flags& f = engine::cli::flags();
  engine::MeasureOptions o;
  o.rows_large = std::max<int64_t>(2, f.batch_size / f.accum_steps);
  o.rows_small = std::max<int64_t>(1, o.rows_large / 4);
  if (o.rows_small == o.rows_large) o.rows_small = o.rows_large / 2;
  o.amp = engine::parse_amp(f.amp);
  o.tokens_per_row = static_cast<double>(FLAGS_seq_len);
  if (m.name == "gpt" || m.name == "llama") o.flops_per_row = simulator_shape(m.name).flops_per_token() * FLAGS_seq_len;
  sim::MeasuredModel mm = engine::measure_model(*m.spec, run.device, m.synthetic_batch, o);
  mm.name = m.name;
  if (m.name == "gpt" || m.name == "llama") mm.shape = simulator_shape(m.name).to_string();
  mm.device = run.device.is_cuda() ? "cuda" : "cpu";  // the calibrated device's name is calibrated-<this>
  if (run.world.rank != 0) return;
  std::ofstream out(path);
  DTRAIN_CHECK(out.good(), "--measure=", path, " cannot be written; give a writable path");
  out << mm.to_json() << "\n";
  out.close();
  DTRAIN_CHECK(out.good(), "--measure=", path, ": writing failed (disk full?)");
  std::printf("measure: %s\nmeasure: wrote %s\n", mm.to_string().c_str(), path.c_str());
}

}  // namespace dtrain::examples
