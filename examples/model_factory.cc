#include "model_factory.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/amp.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include <gflags/gflags.h>
#include <glog/logging.h>
#include <cstdio>
#include <fstream>
#include <sstream>
#include "dtrain/engine/parallel/context_parallel.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/models/classifiers.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/train/hf_gpt2.h"
#include "dtrain/engine/train/hf_llama.h"
#include <nlohmann/json.hpp>
#include "dtrain/engine/models/seq2seq.h"

DECLARE_string(teacher);  // distill.cc

namespace dtrain::examples {
namespace {

constexpr int64_t kMlpFeatures = 64, kMlpClasses = 10;  // the digits data

at::Tensor random_tokens(int64_t rows, int64_t len, c10::Device device) {
  return at::randint(FLAGS_vocab, {rows, len}, at::TensorOptions().dtype(at::kLong).device(device));
}

// The shape flags every transformer reads (seq2seq's, gpt's and llama's options name them alike).
template <class Options>
void set_shape_of_flags(Options& o) {
  o.vocab = FLAGS_vocab;
  o.d_model = FLAGS_d_model;
  o.heads = FLAGS_heads;
  o.ff = FLAGS_ff;
  o.layers = FLAGS_layers;
}

// The shape flags and the dropout flags seq2seq and gpt read.
template <class Options>
Options transformer_options() {
  Options o;
  set_shape_of_flags(o);
  o.dropout = FLAGS_dropout;
  o.sparse_embedding = FLAGS_sparse_embedding;
  return o;
}

ExampleModel seq2seq(const Run& run) {
  const int64_t S = FLAGS_seq_len;
  auto mo = transformer_options<engine::Seq2SeqOptions>();
  mo.max_len = S;
  mo.inplace = FLAGS_inplace;
  mo.checkpoint_activations = engine::cli::flags().checkpoint_activations;
  mo.checkpoint_layers = engine::cli::flags().checkpoint_blocks;
  torch::manual_seed(engine::cli::flags().seed);
  auto model = engine::Seq2Seq(mo).ptr();
  model->to(run.device);
  ExampleModel m;
  m.name = "seq2seq";
  m.module = model;
  m.loss = [model, S](const engine::Batch& b) {
    const at::Tensor& w = b.fields[0];  // [B, 2S+1]
    return model->loss(w.narrow(1, 0, S), w.narrow(1, S, S), w.narrow(1, S + 1, S));
  };
  const c10::Device device = run.device;
  m.synthetic_batch = [S, device](int64_t rows) {
    engine::Batch b;
    b.fields.push_back(random_tokens(rows, 2 * S + 1, device));
    return b;
  };
  m.set_checkpointing = [model](bool on, int blocks) {
    model->options.checkpoint_activations = on;
    model->options.checkpoint_layers = blocks;
  };
  m.block_prefixes = {"encoder.", "decoder."};
  m.blocks = 2 * FLAGS_layers;
  m.input_bytes_per_row = (2 * S + 1) * 8;
  m.largest_activation_bytes_per_row = S * FLAGS_vocab * 4;  // the fp32 logits
  m.default_optimizer = "adagrad";
  m.inputs = [S](const engine::Batch& b) {
    const at::Tensor& w = b.fields[0];
    return std::vector<at::Tensor>{w.narrow(1, 0, S), w.narrow(1, S, S)};  // source, decoder input
  };
  m.forward = [model](const std::vector<at::Tensor>& in) { return model->forward(in.at(0), in.at(1)); };
  m.logits_and_targets = [model, S](const engine::Batch& b) {
    const at::Tensor& w = b.fields[0];
    at::Tensor logits = model->forward(w.narrow(1, 0, S), w.narrow(1, S, S));
    return std::make_pair(logits.reshape({-1, logits.size(-1)}), w.narrow(1, S + 1, S).reshape({-1}));
  };
  m.classes = FLAGS_vocab;
  return m;
}

// --hf_config, read once (every rank reads the same file): whether it is a GPT-2 config, and its
// shape: a Llama config, or a GPT-2 config in the Llama options' common fields (vocab, sizes,
// layers, positions, tie).
struct HfConfig {
  bool gpt2 = false;
  engine::LlamaOptions options;
};

const HfConfig& hf_config() {
  static const HfConfig c = [] {
    const std::string text = read_text_file(FLAGS_hf_config, "--hf_config");
    HfConfig c;
    try {
      c.gpt2 = nlohmann::json::parse(text).value("model_type", std::string()) == "gpt2";
    } catch (const nlohmann::json::exception&) {
      c.gpt2 = false;  // the model's own reader names what is wrong with the file
    }
    if (!c.gpt2) {
      c.options = engine::llama_options_from_hf_config(text);
      return c;
    }
    const engine::GptOptions g = engine::gpt_options_from_hf_config(text);
    c.options.vocab = g.vocab;
    c.options.d_model = g.d_model;
    c.options.heads = g.heads;
    c.options.kv_heads = g.heads;
    c.options.ff = g.ff;
    c.options.layers = g.layers;
    c.options.seq_len = g.seq_len;
    c.options.tie_embeddings = g.tie_embeddings;
    return c;
  }();
  return c;
}

}  // namespace

std::string read_text_file(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK(in.good(), flag, "=", path, ": cannot open the file to read");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void apply_hf_config() {
  if (FLAGS_hf_config.empty()) return;
  const engine::LlamaOptions& o = hf_config().options;
  std::vector<std::pair<std::string, std::string>> shape = {
      {"vocab", std::to_string(o.vocab)}, {"d_model", std::to_string(o.d_model)}, {"heads", std::to_string(o.heads)},
      {"ff", std::to_string(o.ff)},       {"layers", std::to_string(o.layers)},
      {"tie_embeddings", o.tie_embeddings ? "true" : "false"}};
  if (!hf_config().gpt2) {
    shape.emplace_back("kv_heads", std::to_string(o.kv_heads > 0 ? o.kv_heads : o.heads));
    shape.emplace_back("rope_theta", std::to_string(o.rope_theta));
  }
  for (const auto& [flag, value] : shape) {
    gflags::CommandLineFlagInfo info;
    gflags::GetCommandLineFlagInfo(flag.c_str(), &info);
    const bool same = flag == "rope_theta" ? std::stod(info.current_value) == o.rope_theta : info.current_value == value;
    DTRAIN_CHECK(info.is_default || same, "--", flag, "=", info.current_value, " disagrees with --hf_config=",
                 FLAGS_hf_config, " (", value, "); drop --", flag, ": the config gives the model's shape");
    gflags::SetCommandLineOption(flag.c_str(), value.c_str());
  }
  DTRAIN_CHECK(FLAGS_seq_len <= o.seq_len, "--seq_len=", FLAGS_seq_len, " is longer than --hf_config=", FLAGS_hf_config,
               "'s positions (", o.seq_len, "); use a --seq_len of at most that");
}

int64_t llama_max_positions() {
  return FLAGS_hf_config.empty() ? FLAGS_seq_len : std::max(FLAGS_seq_len, hf_config().options.seq_len);
}

engine::LlamaOptions llama_flag_options() {
  engine::LlamaOptions o = FLAGS_hf_config.empty() ? engine::LlamaOptions{} : hf_config().options;
  set_shape_of_flags(o);
  o.kv_heads = FLAGS_kv_heads;
  o.seq_len = FLAGS_seq_len;
  o.rope_theta = FLAGS_rope_theta;
  o.tie_embeddings = FLAGS_tie_embeddings;
  return o;
}

namespace {

// --init_from_hf: the loader of this rank's stage (null without the flag).
std::function<void(torch::nn::Module&)> hf_loader(const Run& run, engine::HfNames names) {
  if (FLAGS_init_from_hf.empty()) return nullptr;
  return [&run, names](torch::nn::Module& stage) {
    const int64_t n = engine::load_hf_weights(FLAGS_init_from_hf, stage, run.mesh->tp(), names, run.mesh->pp_size() > 1);
    if (run.world.rank == 0) LOG(INFO) << "loaded " << n << " tensors from " << FLAGS_init_from_hf;
  };
}

// A decoder language model of the library (GPT, Llama: the same method names) given by its
// spec; `load` (may be null) fills this stage's weights after the pipeline split and before the
// move to the device.
template <class Impl>
ExampleModel decoder_lm(const Run& run, const std::string& name, std::shared_ptr<Impl> model, engine::ModelSpec spec,
                        const std::function<void(torch::nn::Module&)>& load) {
  const int64_t S = FLAGS_seq_len;
  ExampleModel m;
  // The library's model: its spec, split for this pipeline stage before anything goes to the
  // device (every stage drew the whole model from the seed and keeps its part).
  engine::ModelTechniques t;
  engine::split_pipeline_stage(spec, run.mesh->pp_rank(), run.mesh->pp_size(), engine::cli::flags().pp_blocks, t,
                               engine::cli::pipeline_chunks(engine::cli::flags()));
  if (load) load(*model);
  model->to(run.device);
  t.checkpoint_activations = engine::cli::flags().checkpoint_activations;
  t.checkpoint_blocks = engine::cli::flags().checkpoint_blocks;
  t.device = run.device;
  m.spec = spec;
  // For what runs outside the trainer (memory probes, a teacher): the spec with checkpointing
  // and streaming as asked; the trainer applies its own.
  m.applied = std::make_shared<engine::AppliedModel>(spec, t);
  m.first_stage = m.applied->first_stage();
  m.last_stage = m.applied->last_stage();
  if (run.mesh->pp_size() > 1) {
    m.stage_forward = [a = m.applied](const at::Tensor& x, const engine::Batch& b) { return a->stage_forward(x, b); };
    m.stage_activation_shape = spec.activation_shape;
  }
  m.name = name;
  m.module = model;
  m.loss = [a = m.applied](const engine::Batch& b) { return a->loss(b); };
  const c10::Device device = run.device;
  m.synthetic_batch = [S, device](int64_t rows) {
    engine::Batch b;
    b.fields.push_back(random_tokens(rows, S + 1, device));
    return b;
  };
  m.set_checkpointing = [a = m.applied](bool on, int blocks) { a->set_checkpoint_activations(on, blocks); };
  m.block_prefixes = {"blocks."};
  m.blocks = static_cast<int>(model->blocks->size());  // a pipeline stage's own
  // ZeRO-3's units: --shard_units, else the embeddings, each block, the head (a stage's own).
  m.unit_starts = engine::cli::flags().shard_units.empty() ? engine::default_unit_prefixes(spec)
                                                           : engine::cli::trainer_options(engine::cli::flags(), "adamw")
                                                                 .shard_unit_starts;
  m.input_bytes_per_row = (S + 1) * 8;
  const int64_t tp = run.mesh->tp_size();
  const int64_t local = S / run.mesh->cp_size();  // context-parallel: this rank's part of a sequence
  // The logits (the last stage's; an earlier stage's largest is the activation it sends).
  m.largest_activation_bytes_per_row =
      m.last_stage ? local * ((FLAGS_vocab + tp - 1) / tp) * 4 : local * model->options.d_model * 4;
  m.default_optimizer = "adamw";
  m.offload_layers = [a = m.applied] { a->stream_blocks(); };
  m.inputs = [S](const engine::Batch& b) { return std::vector<at::Tensor>{b.fields[0].narrow(1, 0, S)}; };
  m.forward = [model](const std::vector<at::Tensor>& in) { return model->forward(in.at(0)); };
  m.logits_and_targets = [model, S](const engine::Batch& b) {
    const at::Tensor& w = b.fields[0];
    at::Tensor logits = model->forward(w.narrow(1, 0, S));  // context-parallel: this rank's tokens
    at::Tensor targets = w.narrow(1, 1, S);
    if (model->cp) targets = engine::cp_split_sequence(targets, 1, model->cp->rank(), model->cp->size());
    return std::make_pair(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  };
  m.classes = FLAGS_vocab;
  m.vocab_parallel = true;
  m.parameter_count = model->parameter_count();
  return m;
}

ExampleModel gpt(const Run& run) {
  auto mo = transformer_options<engine::GptOptions>();
  mo.seq_len = FLAGS_seq_len;
  mo.sequence_parallel = engine::cli::flags().sequence_parallel;
  mo.tie_embeddings = FLAGS_tie_embeddings;
  torch::manual_seed(engine::cli::flags().seed);
  auto model = engine::Gpt(mo, run.mesh->tp(), &run.mesh->cp()).ptr();
  return decoder_lm(run, "gpt", model, engine::gpt_spec(model), hf_loader(run, engine::gpt2_hf_names(mo)));
}

ExampleModel llama(const Run& run) {
  engine::LlamaOptions mo = llama_flag_options();
  mo.sequence_parallel = engine::cli::flags().sequence_parallel;
  torch::manual_seed(engine::cli::flags().seed);
  auto model = engine::Llama(mo, run.mesh->tp(), &run.mesh->cp()).ptr();
  return decoder_lm(run, "llama", model, engine::llama_spec(model), hf_loader(run, engine::llama_hf_names()));
}

// A classifier of the digits images (64 pixels per row, 10 classes) as train_mlp and
// train_cnn read them: `module` maps [rows, 64] pixels to [rows, 10] logits.
template <class Net>
ExampleModel digits_classifier(const std::string& name, std::shared_ptr<Net> model, c10::Device device) {
  ExampleModel m;
  m.name = name;
  m.module = model;
  m.loss = [model](const engine::Batch& b) {
    return torch::nn::functional::cross_entropy(model->forward(b.fields[0]), b.fields[1]);
  };
  m.eval_loss_and_correct = [model](const engine::Batch& b) { return loss_and_correct(model->forward(b.fields[0]), b.fields[1]); };
  m.synthetic_batch = [device](int64_t rows) {
    engine::Batch b;
    b.fields.push_back(at::rand({rows, kMlpFeatures}, at::TensorOptions().device(device)));
    b.fields.push_back(at::randint(kMlpClasses, {rows}, at::TensorOptions().dtype(at::kLong).device(device)));
    return b;
  };
  m.input_bytes_per_row = kMlpFeatures * 4 + 8;
  m.default_optimizer = "adamw";
  m.inputs = [](const engine::Batch& b) { return std::vector<at::Tensor>{b.fields[0]}; };
  m.forward = [model](const std::vector<at::Tensor>& in) { return model->forward(in.at(0)); };
  m.logits_and_targets = [model](const engine::Batch& b) { return std::make_pair(model->forward(b.fields[0]), b.fields[1]); };
  m.classes = kMlpClasses;
  return m;
}

ExampleModel mlp(const Run& run) {
  torch::manual_seed(engine::cli::flags().seed);
  engine::MlpOptions mo;
  mo.in_features = kMlpFeatures;
  mo.hidden = FLAGS_hidden;
  mo.depth = FLAGS_depth;
  mo.classes = kMlpClasses;
  mo.inplace = FLAGS_inplace;
  auto model = engine::make_mlp(mo).ptr();
  model->to(run.device);
  ExampleModel m = digits_classifier("mlp", model, run.device);
  m.largest_activation_bytes_per_row = std::max<int64_t>(FLAGS_hidden, kMlpClasses) * 4;
  return m;
}

ExampleModel cnn(const Run& run) {
  torch::manual_seed(engine::cli::flags().seed);
  auto model = std::make_shared<engine::ConvNet>(FLAGS_hidden, FLAGS_inplace, engine::cli::flags().checkpoint_activations);
  model->to(run.device);
  ExampleModel m = digits_classifier("cnn", model, run.device);
  m.largest_activation_bytes_per_row = 64 * kMlpFeatures * 4;  // the second convolution's output
  return m;
}

bool has_prefix(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes) {
    if (name.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

}  // namespace

std::string flag_from_argv(int argc, char** argv, const std::string& name, const std::string& fallback) {
  const std::string eq = "--" + name + "=", bare = "--" + name;
  std::string value = fallback;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind(eq, 0) == 0) value = a.substr(eq.size());
    if (a == bare && i + 1 < argc) value = argv[i + 1];
  }
  return value;
}

std::vector<std::string> model_flag_names(const std::string& model) {
  if (model == "mlp") return {"hidden", "depth"};
  if (model == "cnn") return {"hidden"};
  if (model == "llama") {
    return {"d_model", "heads", "kv_heads", "layers", "ff", "seq_len", "vocab", "rope_theta", "tie_embeddings",
            "hf_config", "init_from_hf"};
  }
  if (model == "gpt") {
    return {"d_model", "heads", "layers", "ff", "seq_len", "vocab", "dropout", "tie_embeddings", "hf_config",
            "init_from_hf"};
  }
  return {"d_model", "heads", "layers", "ff", "seq_len", "vocab", "dropout"};
}

std::map<std::string, std::string> model_flag_defaults(const std::string& model) {
  if (model == "seq2seq") {
    return {{"lr", "0.01"}, {"batch_size", "16"}, {"steps", "100"}, {"seq_len", "256"}};
  }
  if (model == "gpt") {
    return {{"lr", "0.0006"},        {"batch_size", "8"},      {"steps", "100"},
            {"d_model", "768"},      {"heads", "12"},          {"layers", "12"},
            {"ff", "3072"},          {"seq_len", "1024"},      {"dropout", "0"},
            {"weight_decay", "0.1"}, {"clip_grad_norm", "1.0"}};
  }
  if (model == "llama") {  // a small Llama (GPT-2 small's width, grouped-query attention)
    return {{"lr", "0.0003"},        {"batch_size", "8"},      {"steps", "100"},
            {"d_model", "768"},      {"heads", "12"},          {"kv_heads", "4"},
            {"layers", "12"},        {"ff", "2048"},           {"seq_len", "1024"},
            {"dropout", "0"},        {"weight_decay", "0.1"},  {"clip_grad_norm", "1.0"}};
  }
  if (model == "mlp") return {{"lr", "0.001"}, {"batch_size", "64"}, {"steps", "200"}};
  if (model == "cnn") return {{"lr", "0.001"}, {"batch_size", "64"}, {"steps", "200"}, {"hidden", "128"}};
  DTRAIN_CHECK(false, "--model=", model, " is not one of: seq2seq, gpt, llama, mlp, cnn");
  return {};
}

std::function<void()> model_checks(const std::string& model) {
  if (model != "gpt" && model != "llama") return nullptr;
  return [llama = model == "llama"] {
    const int64_t T = engine::cli::flags().tp;
    DTRAIN_CHECK(FLAGS_heads % T == 0, "--heads=", FLAGS_heads, " does not divide over --tp=", T,
                 "; the number of heads must be a multiple of the tensor-parallel size");
    DTRAIN_CHECK(!llama || (FLAGS_kv_heads > 0 ? FLAGS_kv_heads : FLAGS_heads) % T == 0, "--kv_heads=", FLAGS_kv_heads,
                 " key/value heads do not divide over --tp=", T, "; choose a --tp that divides the key/value heads");
    DTRAIN_CHECK(FLAGS_hf_config.empty() || hf_config().gpt2 == !llama, "--hf_config=", FLAGS_hf_config, " is a ",
                 llama ? "GPT-2" : "Llama", " config; use --model=", llama ? "gpt" : "llama");
    gflags::CommandLineFlagInfo dropout;
    gflags::GetCommandLineFlagInfo("dropout", &dropout);
    DTRAIN_CHECK(!llama || dropout.is_default || FLAGS_dropout == 0, "--dropout=", FLAGS_dropout,
                 ": the Llama model has no dropout; drop --dropout");
    DTRAIN_CHECK(!llama || !FLAGS_sparse_embedding, "--sparse_embedding is for --model=gpt; drop it");
    DTRAIN_CHECK(FLAGS_ff % T == 0, "--ff=", FLAGS_ff, " does not divide over --tp=", T,
                 "; the feed-forward width must be a multiple of the tensor-parallel size");
    DTRAIN_CHECK(!engine::cli::flags().sequence_parallel || FLAGS_seq_len % T == 0, "--sequence_parallel: --seq_len=",
                 FLAGS_seq_len, " does not divide over --tp=", T,
                 "; the sequence length must be a multiple of the tensor-parallel size");
    const int64_t C = engine::cli::flags().cp;
    DTRAIN_CHECK(C == 1 || FLAGS_seq_len % (2 * C) == 0, "--seq_len=", FLAGS_seq_len, " does not split into 2 x --cp=", C,
                 " equal chunks (context parallelism gives each rank a chunk from the front and its mirror from the "
                 "back); use a sequence length that is a multiple of ", 2 * C);
    DTRAIN_CHECK(C == 1 || !engine::cli::flags().sequence_parallel || FLAGS_seq_len % (2 * C * T) == 0,
                 "--sequence_parallel with --cp=", C, ": each rank's ", FLAGS_seq_len / C,
                 " tokens do not divide over --tp=", T, "; use a sequence length that is a multiple of ", 2 * C * T);
    if (C > 1) {  // the example's own features not built for a split sequence
      const char* unsupported = !FLAGS_teacher.empty()    ? "--teacher"
                                : !FLAGS_quantize.empty() ? "--quantize"
                                : FLAGS_sparse_embedding  ? "--sparse_embedding"
                                                          : nullptr;
      DTRAIN_CHECK(unsupported == nullptr, unsupported ? unsupported : "", " with --cp=", C,
                   " is not supported yet; train with --cp=1, or without ", unsupported ? unsupported : "");
    }
    DTRAIN_CHECK(FLAGS_dropout == 0 || T == 1,
                 "--dropout with --tp > 1 is not supported; "
                 "use --dropout=0 (the default for train_gpt)");
    const int P = engine::cli::flags().pp;
    DTRAIN_CHECK(P > 1 || engine::cli::flags().pp_blocks.empty(), "--pp_blocks=", engine::cli::flags().pp_blocks,
                 " needs --pp > 1 (it gives the blocks of each pipeline stage)");
    engine::pipeline_stage_bounds(FLAGS_layers, P, engine::cli::flags().pp_blocks);  // fewer blocks than stages
    if (P > 1) {  // the example's own features (the trainer refuses the engine's it cannot combine)
      const char* unsupported = !FLAGS_teacher.empty()                   ? "--teacher"
                                : !FLAGS_quantize.empty()               ? "--quantize"
                                : FLAGS_sparse_embedding                 ? "--sparse_embedding"
                                // each stage's units: its embeddings, each of its blocks, its head
                                : !engine::cli::flags().shard_units.empty() ? "--shard_units"
                                                                         : nullptr;
      DTRAIN_CHECK(unsupported == nullptr, unsupported ? unsupported : "", " with --pp=", P,
                   " is not supported yet; train with --pp=1, or without ", unsupported ? unsupported : "");
    }
    if (engine::cli::flags().shard == "parameters") {  // ZeRO-3: the example's features it does not take yet
      const std::string& offload = engine::cli::flags().offload;
      const char* unsupported = offload == "layers" || offload == "all" ? "--offload=layers"
                                : !FLAGS_teacher.empty()               ? "--teacher"
                                : !FLAGS_quantize.empty()              ? "--quantize"
                                : engine::cli::flags().plan == "auto"  ? "--plan=auto"
                                                                       : nullptr;
      DTRAIN_CHECK(unsupported == nullptr, "--shard=parameters with ", unsupported ? unsupported : "",
                   " is not supported yet; use --shard=gradients, or drop ", unsupported ? unsupported : "");
    }
  };
}

ExampleModel build_example_model(const std::string& model, const Run& run) {
  model_flag_defaults(model);  // validates the name
  ExampleModel m = model == "seq2seq" ? seq2seq(run)
                   : model == "gpt"   ? gpt(run)
                   : model == "llama" ? llama(run)
                   : model == "cnn"   ? cnn(run)
                                      : mlp(run);
  DTRAIN_CHECK(engine::cli::flags().checkpoint_blocks == -1 || m.set_checkpointing, "--checkpoint_blocks=",
               engine::cli::flags().checkpoint_blocks, ": the ", model, " model has no blocks to choose from; drop "
               "--checkpoint_blocks");
  m.module->train();
  return m;
}

engine::PlanInputs plan_inputs(const Run& run, ExampleModel& m, const engine::TrainerOptions& options) {
  engine::cast_parameters(*m.module, options.param_dtype);
  engine::PlanInputs in;
  in.offload_delayed_update = options.offload.delayed_update_after >= 0;
  in.offload_to_device = !run.device.is_cpu();
  const auto specs = engine::collect_shard_specs(*m.module);
  const int tp = run.mesh->tp_size();
  const engine::TrainedParameters trained = engine::trained_parameters(*m.module);  // tied ones once
  for (size_t i = 0; i < trained.params.size(); ++i) {
    const at::Tensor& p = trained.params[i];
    const bool sharded = specs.count(trained.names[i]) > 0;
    const int64_t full = sharded ? p.numel() * tp : p.numel();
    in.parameters += full;
    if (sharded) in.sharded_parameters += full;
    if (has_prefix(trained.names[i], m.block_prefixes)) in.layer_parameters += full;
    in.bytes_per_parameter = static_cast<int64_t>(p.element_size());
  }
  for (const at::Tensor& p : m.module->parameters()) {
    if (!p.requires_grad()) in.buffer_bytes += static_cast<int64_t>(p.nbytes());  // frozen: as static as a buffer
  }
  for (const at::Tensor& b : m.module->buffers())
    in.buffer_bytes += static_cast<int64_t>(b.nbytes());
  in.tp = tp;
  in.dp = run.mesh->replicas().size();  // the ranks the optimizer state splits over (dp x cp)
  in.layers = m.blocks;
  // The library's decoders stack one block type; the seq2seq's encoder and decoder layers differ.
  in.uniform_blocks = m.spec.has_value();
  in.input_bytes_per_row = m.input_bytes_per_row;
  in.input_batches = 1 + engine::cli::flags().prefetch;  // the step's batch and the loader's prefetched ones
  in.optimizer = options.optimizer.name;
  in.momentum = options.optimizer.momentum;
  in.amsgrad = options.optimizer.amsgrad;
  in.batch_size = engine::cli::flags().batch_size;
  in.amp = options.amp;
  in.can_checkpoint = static_cast<bool>(m.set_checkpointing);
  in.largest_activation_bytes_per_row = m.largest_activation_bytes_per_row;
  in.cuda_context_bytes = run.device.is_cuda() ? engine::kDefaultCudaContextBytes : 0;
  // ZeRO-3's largest unit (cut as the trainer cuts them), in this rank's elements.
  if (!m.unit_starts.empty()) {
    std::vector<size_t> starts = engine::unit_starts_of(trained.names, m.unit_starts);
    starts.push_back(trained.names.size());
    for (size_t k = 0; k + 1 < starts.size(); ++k) {
      int64_t unit = 0;
      for (size_t j = starts[k]; j < starts[k + 1]; ++j) unit += trained.params[j].numel();
      in.largest_unit_parameters = std::max(in.largest_unit_parameters, unit);
    }
  }
  in.pp = run.mesh->pp_size();  // the counts above are this stage's: `module` is the stage
  in.stage = run.mesh->pp_rank();
  if (in.pp > 1 && m.spec) {
    // The fewest blocks a stage holds, as the trainer splits the model (--pp_blocks or evenly).
    const std::vector<int> bounds = engine::pipeline_stage_bounds(FLAGS_layers, in.pp, engine::cli::flags().pp_blocks);
    in.fewest_stage_layers = FLAGS_layers;
    for (int s = 0; s < in.pp; ++s) in.fewest_stage_layers = std::min(in.fewest_stage_layers, bounds[s + 1] - bounds[s]);
  }
  in.pp_schedule = engine::parse_pipeline_schedule(engine::cli::flags().pp_schedule);
  in.pp_chunks = engine::cli::pipeline_chunks(engine::cli::flags());
  if (in.pp > 1 && in.pp_schedule == engine::PipelineSchedule::kZeroBubble && (m.name == "gpt" || m.name == "llama")) {
    // The boundary operations' output gradients, per token: each Linear's output features (its
    // 2-D weight's rows, this rank's), each norm's width (its 1-D scale); not the embeddings,
    // which end the first stage's graph (no boundary beyond them).
    int64_t linear = 0, norm = 0;
    for (const auto& item : m.module->named_modules()) {
      const std::string& name = item.key();
      if (name.find("wte") != std::string::npos || name.find("wpe") != std::string::npos ||
          name.find("embed") != std::string::npos) {
        continue;
      }
      for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
        if (p.key() != "weight" || !p.value().requires_grad()) continue;
        if (p.value().dim() == 2) linear += p.value().size(0);
        if (p.value().dim() == 1) norm += p.value().size(0);
      }
    }
    const int64_t tokens = FLAGS_seq_len / std::max(1, run.mesh->cp_size());
    const int64_t linear_bytes = options.amp == engine::AmpMode::kOff ? 4 : 2;
    in.weight_grad_capture_bytes_per_row = tokens * (linear * linear_bytes + norm * 4);
  }
  return in;
}

engine::ActivationProfile probe_example_model(const Run& run, ExampleModel& m,
                                              const std::vector<engine::AmpMode>& amps,
                                              int64_t probe_rows) {
  engine::ProbeOptions po;
  po.rows_small = probe_rows;
  po.rows_large = 2 * probe_rows;
  po.techniques.clear();
  for (engine::AmpMode a : amps) {
    po.techniques.push_back({false, a});
    if (m.set_checkpointing) po.techniques.push_back({true, a});
  }
  const bool was_training = m.module->is_training();
  m.module->train();
  engine::ActivationProfile profile;
  try {
    profile = engine::probe_activations(
        [&](int64_t rows, bool checkpoint) {
          if (m.set_checkpointing) m.set_checkpointing(checkpoint, -1);
          if (!m.stage_forward) return m.loss(m.synthetic_batch(rows));
          // A pipeline stage: the activation it would receive (a leaf that needs its gradient,
          // as the trainer's), its forward, and for all but the last stage a backward seeded
          // with a gradient of the sent activation's shape, as the next stage would return.
          at::Tensor x;
          if (!m.first_stage) {
            x = at::randn(m.stage_activation_shape(rows), at::TensorOptions().device(run.device)).requires_grad_();
          }
          at::Tensor y = m.stage_forward(x, m.synthetic_batch(rows));
          return m.last_stage ? y : (y * at::randn_like(y)).sum();
        },
        m.module->parameters(), run.device, po);
  } catch (...) {
    checkpoint_as_flags(m);
    m.module->train(was_training);
    throw;
  }
  checkpoint_as_flags(m);
  m.module->train(was_training);
  return profile;
}

void checkpoint_as_flags(ExampleModel& m) {
  if (m.set_checkpointing) {
    m.set_checkpointing(engine::cli::flags().checkpoint_activations, engine::cli::flags().checkpoint_blocks);
  }
}

std::vector<std::vector<double>> per_stage(const Run& run, const std::vector<double>& mine) {
  const int P = run.mesh->pp_size();
  const int64_t n = static_cast<int64_t>(mine.size());
  at::Tensor t = at::zeros({P * n}, at::kDouble);
  if (run.mesh->replicas().rank() == 0 && run.mesh->tp_rank() == 0) {
    for (int64_t i = 0; i < n; ++i) t[run.mesh->pp_rank() * n + i] = mine[i];
  }
  if (P > 1) run.comm->all_reduce(t, dist::ReduceOp::kSum)->wait();
  std::vector<std::vector<double>> out(P);
  const double* p = t.data_ptr<double>();
  for (int s = 0; s < P; ++s) out[s].assign(p + s * n, p + (s + 1) * n);
  return out;
}

std::string stage_estimates(const Run& run, const engine::MemoryEstimate& mine) {
  if (run.mesh->pp_size() == 1) return "";
  const auto stages = per_stage(run, {static_cast<double>(mine.gpu.allocated_peak()), static_cast<double>(mine.in_flight)});
  std::string out;
  for (size_t s = 0; s < stages.size(); ++s) {
    char line[160];
    std::snprintf(line, sizeof line, "%s: plan: stage %zu estimate: allocated peak %.1f MiB, %d micro-batches in flight\n",
                  run.program.c_str(), s, stages[s][0] / (1024.0 * 1024.0), static_cast<int>(stages[s][1]));
    out += line;
  }
  return out;
}

std::unique_ptr<engine::Trainer> make_trainer(const Run& run, const ExampleModel& model,
                                              const engine::TrainerOptions& options) {
  if (model.spec) return std::make_unique<engine::Trainer>(*model.spec, *run.mesh, run.device, options);
  return std::make_unique<engine::Trainer>(*model.module, model.loss, *run.mesh, run.device, options);
}

engine::sim::ModelShape simulator_shape(const std::string& model) {
  DTRAIN_CHECK(model == "gpt" || model == "llama", "the step-time simulator prices the language models ",
               "(--model=gpt or llama); --model=", model, " is not one");
  DTRAIN_CHECK(FLAGS_hf_config.empty() || hf_config().gpt2 == (model == "gpt"), "--hf_config=", FLAGS_hf_config,
               " is a ", model == "gpt" ? "Llama" : "GPT-2", " config; use --model=", model == "gpt" ? "llama" : "gpt");
  engine::sim::ModelShape m;
  m.family = model;
  m.layers = FLAGS_layers;
  m.d_model = FLAGS_d_model;
  m.heads = FLAGS_heads;
  m.kv_heads = model == "llama" ? FLAGS_kv_heads : 0;
  m.ff = FLAGS_ff;
  m.vocab = FLAGS_vocab;
  m.seq_len = FLAGS_seq_len;
  m.tie_embeddings = FLAGS_tie_embeddings;
  return m;
}

engine::sim::Layout simulator_layout(int tp, int pp, int cp, int dp) {
  const engine::cli::Flags& f = engine::cli::flags();
  engine::sim::Layout l;
  l.tp = tp, l.pp = pp, l.cp = cp, l.dp = dp;
  DTRAIN_CHECK(f.batch_size % f.accum_steps == 0, "--batch_size=", f.batch_size, " is not a multiple of --accum_steps=",
               f.accum_steps);
  l.accum_steps = f.accum_steps;
  l.micro_batch_rows = f.batch_size / f.accum_steps;
  l.zero = static_cast<int>(engine::parse_shard_mode(f.shard));
  const engine::OffloadChoice offload = engine::parse_offload(f.offload);
  l.offload_optimizer = offload.optimizer;
  l.offload_layers = offload.layers;
  l.delayed_update = f.offload_delayed_update_after >= 0;
  l.checkpoint = f.checkpoint_activations;
  l.checkpoint_blocks = f.checkpoint_blocks;  // -1 unless checkpointing (the flags' validation)
  l.sequence_parallel = f.sequence_parallel;
  l.bf16 = f.amp != "off";
  l.param_bf16 = engine::parse_param_dtype(f.param_dtype) == at::kBFloat16;
  l.schedule = engine::parse_pipeline_schedule(f.pp_schedule);
  l.chunks = engine::cli::pipeline_chunks(f);
  l.stage_blocks = f.pp_blocks;
  return l;
}

std::function<double(const engine::Technique&)> simulator_step_time(const Run& run, const std::string& model) {
  const engine::cli::Flags& f = engine::cli::flags();
  if (f.plan_cluster.empty()) return nullptr;
  const engine::sim::ModelShape shape = simulator_shape(model);
  engine::sim::Cluster cluster = engine::sim::cluster_from_json(read_text_file(f.plan_cluster, "--plan_cluster"));
  cluster.gpus_per_node = run.world.local_size;
  cluster.nodes = run.world.size / run.world.local_size;
  // The run's mesh and flags; each candidate technique replaces what it chooses.
  engine::sim::Layout base = simulator_layout(run.mesh->tp_size(), run.mesh->pp_size(), run.mesh->cp_size(),
                                              run.mesh->dp().size());
  base.sequence_parallel = base.sequence_parallel && base.tp > 1;
  const int64_t rows = f.batch_size;
  return [shape, cluster, base, rows](const engine::Technique& t) {
    engine::sim::Layout l = base;
    l.accum_steps = t.accum_steps;
    l.micro_batch_rows = rows / t.accum_steps;
    l.checkpoint = t.checkpoint;
    l.checkpoint_blocks = t.checkpoint ? t.checkpoint_blocks : -1;
    l.bf16 = t.amp != engine::AmpMode::kOff;
    l.offload_optimizer = t.offload_optimizer;
    l.offload_layers = t.offload_layers;
    l.delayed_update = base.delayed_update && (t.offload_optimizer || t.offload_layers);
    l.zero = t.shard;
    return engine::sim::simulate(shape, cluster, l).step_s;
  };
}

int64_t held_besides_model(const Run& run, ExampleModel& model) {
  int64_t model_bytes = 0;
  for (const at::Tensor& t : model.module->parameters()) model_bytes += static_cast<int64_t>(t.nbytes());
  for (const at::Tensor& t : model.module->buffers()) model_bytes += static_cast<int64_t>(t.nbytes());
  return std::max<int64_t>(0, std::llround(engine::memory_stats(run.device).allocated_mb * 1024.0 * 1024.0) - model_bytes);
}

void plan_and_apply(const Run& run, ExampleModel& model, engine::TrainerOptions& options) {
  const bool planning = engine::cli::flags().plan == "auto";
  const int64_t budget = engine::cli::flags().gpu_mem_limit_gb > 0
                             ? static_cast<int64_t>(engine::cli::flags().gpu_mem_limit_gb * 1024.0 * 1024.0 * 1024.0)
                             : 0;
  int64_t allocator_limit = budget > 0 && run.device.is_cuda() ? budget - engine::kDefaultCudaContextBytes : budget;
  engine::OffloadChoice offload = engine::parse_offload(engine::cli::flags().offload);
  DTRAIN_CHECK(planning || engine::cli::flags().plan_cluster.empty(), "--plan_cluster=",
               engine::cli::flags().plan_cluster, " ranks --plan=auto's candidates; add --plan=auto "
               "--gpu_mem_limit_gb=X, or drop --plan_cluster");
  // What the plan chooses may not also be given: it would be replaced without a word.
  for (const char* flag : {"accum_steps", "checkpoint_activations", "checkpoint_blocks"}) {
    DTRAIN_CHECK(!planning || gflags::GetCommandLineFlagInfoOrDie(flag).is_default, "--", flag, " with --plan=auto: "
                 "the plan chooses the micro-batching and the recomputed blocks itself, and would replace it; drop --",
                 flag, ", or drop --plan=auto and give the techniques yourself");
  }
  if (planning) {
    engine::PlanInputs in = plan_inputs(run, model, options);
    in.buffer_bytes += held_besides_model(run, model);
    in.gpu_budget_bytes = budget;
    // --host_mem_limit_gb, else this process's share of the node's MemAvailable.
    in.host_budget_bytes = engine::host_budget_bytes(engine::cli::flags().host_mem_limit_gb, run.world.local_size);
    // Offload moves memory from the device to the host: on a CPU run it frees nothing.
    in.can_offload_optimizer = run.device.is_cuda();
    in.can_offload_layers = run.device.is_cuda() && static_cast<bool>(model.offload_layers) &&
                            run.mesh->tp_size() == 1;
    // ZeRO-1/2 when the data-parallel group has more than one rank and --shard was left at none.
    in.can_shard = run.mesh->replicas().size() > 1 && engine::parse_shard_mode(options.shard) == engine::ShardMode::kNone;
    in.step_time = simulator_step_time(run, model.name);  // --plan_cluster: the simulator's times
    engine::ActivationProfile profile = probe_example_model(run, model, {options.amp}, /*probe_rows=*/2);
    // Every rank applies the plan that fits on every rank (measurements differ slightly
    // between data-parallel ranks, and a pipeline's stages hold different layers).
    engine::Plan plan = engine::choose_plan(in, profile, engine::agreement_over(*run.comm));
    if (model.set_checkpointing) model.set_checkpointing(plan.technique.checkpoint, plan.technique.checkpoint_blocks);
    options.checkpoint_activations = plan.technique.checkpoint;
    options.checkpoint_blocks = plan.technique.checkpoint ? plan.technique.checkpoint_blocks : -1;
    options.accum_steps = plan.technique.accum_steps;
    offload.optimizer = offload.optimizer || plan.technique.offload_optimizer;
    offload.layers = offload.layers || plan.technique.offload_layers;
    allocator_limit = plan.allocator_limit_bytes;
    if (plan.technique.shard > 0) {
      options.shard = plan.technique.shard == 1 ? "optimizer" : plan.technique.shard == 2 ? "gradients" : "parameters";
      // As --shard=parameters: no OOM back-off with pipeline stages (trainer_options).
      if (plan.technique.shard == 3 && engine::cli::flags().pp > 1) options.oom_backoff = false;
    }
    const std::string stages = stage_estimates(run, plan.estimate);
    if (run.world.rank == 0) {
      LOG(INFO) << "--plan=auto: " << plan.reason << "\n" << plan.estimate.to_string();
      std::printf("%s: plan: %s\n%s", run.program.c_str(), plan.technique.flags().empty() ? "(as given)" : plan.technique.flags().c_str(),
                  stages.c_str());
      std::fflush(stdout);
    }
    engine::release_cached_memory(run.device);
  }
  options.offload_optimizer = offload.optimizer;
  options.offload_layers = offload.layers && model.spec.has_value();  // the trainer streams the spec's blocks
  if (offload.layers) {
    DTRAIN_CHECK(static_cast<bool>(model.offload_layers), "--offload=layers: the ", model.name,
                 " model has no blocks to stream");
    if (!model.spec) model.offload_layers();
  }
  if (allocator_limit > 0 && engine::apply_memory_limit(run.device, allocator_limit) && run.world.rank == 0) {
    LOG(INFO) << "GPU memory capped at " << allocator_limit / (1024.0 * 1024.0) << " MiB by the caching allocator";
  }
}

}  // namespace dtrain::examples
