// dtrain-export: writes a trained example model (the newest good checkpoint in --checkpoint,
// whatever its layout: tensor-parallel, sharded or offloaded runs included) as a TorchScript
// archive or as safetensors weights, for deployment without dtrain.
//
//   dtrain-export --model=gpt --d_model=... --checkpoint=runs/gpt --format=torchscript --output=gpt.pt
//
// The model is built unsplit (--tp 1) from the shape flags, as the example trains it, and the
// checkpoint's weights are loaded into it exactly as an evaluation-only resume loads them (a
// tensor-parallel checkpoint is gathered; a shape that disagrees with the flags is an error
// naming the parameter). TorchScript: traced in eval mode on --example_rows rows of the
// model's input, then loaded back with torch::jit::load and run on the same inputs; its
// output must equal the module's. --write_example=FILE keeps those inputs and outputs
// (safetensors: input.0, input.1, ..., output) so a deployment can check itself.
//
// --quantize=int8 (safetensors only): the Linear layers' weights are written as int8 with their
// scales ("<layer>.weight" int8 [out, in], "<layer>.weight_scale" float32 [out] or [1]; the
// float weight is int8 x scale), as engine::quantize_dynamic_int8 quantizes them; the other
// tensors stay float32. --write_example then holds the int8 model's output.
//
// --format=hf --tokenizer=tok.model: the SentencePiece model the run was trained with goes beside
// the weights (tokenizer.model and a tokenizer_config.json that transformers' AutoTokenizer reads
// as the same tokenizer; engine::save_hf_tokenizer says how), and config.json names its BOS/EOS
// ids, so that generate() stops where dtrain-generate does. --bos (default true): the Hugging Face
// tokenizer puts BOS before each text, as dtrain-prepare --bos (its default) did for the shards.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>

#include <gflags/gflags.h>
#include <glog/logging.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include "common.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/quantize.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/state/export.h"
#include "dtrain/engine/train/cli.h"
#include "dtrain/engine/train/hf_gpt2.h"
#include "dtrain/engine/train/hf_llama.h"
#include "dtrain/engine/train/load.h"
#include "dtrain/engine/train/trainer.h"
#include "model_factory.h"
#include "samples.h"  // --tokenizer

DEFINE_string(model, "gpt", "the example model to export: mlp, cnn, seq2seq, gpt or llama");
DEFINE_string(checkpoint, "", "the run's checkpoint directory (its --save_dir): the newest good checkpoint is exported");
DEFINE_string(format, "torchscript", "torchscript (an archive torch.jit.load runs), safetensors (the weights) or hf (gpt, llama: a Hugging Face checkpoint directory, config.json and model.safetensors, that transformers' from_pretrained loads as GPT2LMHeadModel or LlamaForCausalLM)");
DEFINE_string(output, "", "the file to write (written atomically; its directory must exist); --format=hf: the directory to write into (it must exist)");
DEFINE_int64(example_rows, 2, "rows of the example input (TorchScript: the model is traced on it)");
DEFINE_string(write_example, "", "also write the example inputs and the model's output on them (safetensors)");
DEFINE_bool(bos, true, "with --format=hf --tokenizer: the Hugging Face tokenizer puts the BOS id before each text (as "
            "dtrain-prepare --bos, its default, did); --bos=false if the shards were prepared with --bos=false");

using namespace dtrain;

namespace {

double max_abs_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

void write_example(const std::vector<at::Tensor>& inputs, const at::Tensor& output, const std::string& model_name) {
  engine::NamedTensorList example;
  for (size_t i = 0; i < inputs.size(); ++i) example.emplace_back("input." + std::to_string(i), inputs[i]);
  example.emplace_back("output", output);
  engine::save_safetensors(FLAGS_write_example, example,
                           {{"dtrain_model", model_name}, {"dtrain_quantize", FLAGS_quantize}});
}

// The flags' checks, all before the checkpoint is read (outputs included).
void check_export_flags(const examples::Run& run) {
  DTRAIN_CHECK(run.world.size == 1, "dtrain-export runs as one process (it builds the unsplit model and gathers a "
               "tensor-parallel checkpoint itself); run it without mpirun/srun");
  DTRAIN_CHECK(FLAGS_format == "torchscript" || FLAGS_format == "safetensors" || FLAGS_format == "hf", "--format=",
               FLAGS_format, " is not one of: torchscript, safetensors, hf");
  DTRAIN_CHECK(FLAGS_format != "hf" || FLAGS_model == "llama" || FLAGS_model == "gpt", "--format=hf --model=",
               FLAGS_model, ": Hugging Face checkpoints are written for --model=gpt (GPT2LMHeadModel) and llama "
               "(LlamaForCausalLM); use --format=safetensors");
  DTRAIN_CHECK(FLAGS_format != "hf" || FLAGS_quantize.empty(), "--format=hf with --quantize: transformers reads "
               "the float weights; drop --quantize");
  DTRAIN_CHECK(!FLAGS_checkpoint.empty(), "--checkpoint is required: the run's --save_dir");
  DTRAIN_CHECK(FLAGS_quantize.empty() || FLAGS_format == "safetensors", "--quantize=int8 --format=", FLAGS_format,
               ": the int8 model is exported as safetensors (int8 weights and their scales); libtorch's tracer cannot "
               "record the packed int8 weights into a TorchScript archive. Use --format=safetensors");
  DTRAIN_CHECK(FLAGS_example_rows >= 1, "--example_rows=", FLAGS_example_rows, " must be >= 1");
  if (FLAGS_format == "hf") {
    struct stat st {};
    DTRAIN_CHECK(::stat(FLAGS_output.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "--output=", FLAGS_output,
                 ": --format=hf writes a checkpoint directory; create it first (mkdir -p ", FLAGS_output, ")");
    engine::check_output_path(FLAGS_output + "/model.safetensors", "--output");
    // An earlier export's tokenizer files beside weights that are not theirs: refused when this
    // export writes none (it replaces them when it writes its own).
    if (FLAGS_tokenizer.empty()) {
      for (const char* name : {"tokenizer.model", "tokenizer_config.json", "tokenizer.json", "generation_config.json"}) {
        DTRAIN_CHECK(::stat((FLAGS_output + "/" + name).c_str(), &st) != 0, "--output=", FLAGS_output, " holds ", name,
                     " of an earlier export; this one writes no tokenizer (no --tokenizer), so it would describe "
                     "another model's weights: give --tokenizer, remove it, or export into an empty directory");
      }
    }
  } else {
    engine::check_output_path(FLAGS_output, "--output");
  }
  if (!FLAGS_write_example.empty()) engine::check_output_path(FLAGS_write_example, "--write_example");
  DTRAIN_CHECK(FLAGS_tokenizer.empty() || FLAGS_format == "hf", "--tokenizer with --format=", FLAGS_format,
               ": the tokenizer is written beside a Hugging Face checkpoint (--format=hf); the other formats hold the "
               "model alone. Drop --tokenizer");
}

// The checkpoint's weights in the unsplit model, as an evaluation-only resume loads them; the
// checkpoint's step.
int64_t load_checkpoint(const examples::Run& run, examples::ExampleModel& m) {
  const int64_t step = engine::load_weights(FLAGS_checkpoint, *m.module, *run.mesh, run.device, examples::shape_meta(run));
  m.module->eval();
  return step;
}

// --format=safetensors (int8 with --quantize); returns what was written, for the summary.
std::string export_safetensors(examples::ExampleModel& m, const std::string& model_name, int64_t step) {
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"dtrain_model", model_name},
                                                 {"dtrain_step", std::to_string(step)},
                                                 {"dtrain_checkpoint", FLAGS_checkpoint}};
  std::string quantized;
  if (!FLAGS_quantize.empty()) {
    engine::QuantizeOptions q;
    q.granularity = engine::parse_quant_granularity(FLAGS_quantize_scales);
    const engine::QuantizeReport report = engine::quantize_dynamic_int8(*m.module, q);
    metadata["dtrain_quantize"] = "int8 symmetric, " + FLAGS_quantize_scales + " scales: weight = int8 * weight_scale";
    std::string layers;
    for (const std::string& name : report.layers) layers += (layers.empty() ? "" : ",") + name;
    metadata["dtrain_quantized_layers"] = layers;
    quantized = "; " + report.summary();
  }
  const engine::NamedTensorList tensors = FLAGS_quantize.empty() ? engine::module_tensors(*m.module)
                                                                 : engine::int8_state(*m.module);
  engine::save_safetensors(FLAGS_output, tensors, metadata);
  if (!FLAGS_write_example.empty()) {  // the (quantized) model's output on example inputs
    torch::NoGradGuard no_grad;
    const std::vector<at::Tensor> inputs = m.inputs(m.synthetic_batch(FLAGS_example_rows));
    write_example(inputs, m.forward(inputs), model_name);
  }
  return std::to_string(tensors.size()) + " tensors" + quantized;
}

// --format=hf: what goes into the directory from_pretrained loads - config.json from the shape
// flags and, with --tokenizer, the tokenizer's files - made before the checkpoint is read, so a
// refused tokenizer (more pieces than the vocabulary, no BOS for --bos) fails before any work.
struct HfExport {
  engine::HfSaveOptions save;
  engine::HfNames names;
  std::map<std::string, std::string> tokenizer_files;  // empty without --tokenizer
  std::string tokenizer;                               // its description
};

HfExport plan_hf_export(const examples::ExampleModel& m, const engine::Tokenizer* tokenizer) {
  HfExport e;
  engine::HfTokenizerOptions t;
  t.add_bos = FLAGS_bos;
  if (FLAGS_model == "gpt") {  // GPT2LMHeadModel: n_positions is the trained length (the table's rows)
    const engine::GptOptions& shape = dynamic_cast<engine::GptImpl&>(*m.module).options;
    e.save.config_json = engine::gpt2_hf_config_json(shape);
    e.names = engine::gpt2_hf_names(shape);
    t.max_length = shape.seq_len;
    t.vocab = shape.vocab;
  } else {
    engine::LlamaOptions shape = examples::llama_flag_options();
    shape.seq_len = examples::llama_max_positions();
    e.save.config_json = engine::llama_hf_config_json(shape);
    e.names = engine::llama_hf_names();
    t.max_length = shape.seq_len;
    t.vocab = shape.vocab;
  }
  if (tokenizer != nullptr) {
    e.tokenizer_files = engine::hf_tokenizer_files(*tokenizer, t);
    e.save.config_json = engine::hf_config_with_tokenizer(e.save.config_json, *tokenizer);
    e.tokenizer = tokenizer->describe();
  }
  return e;
}

std::string export_hf(const examples::Run& run, examples::ExampleModel& m, const HfExport& e) {
  const int64_t n = engine::save_hf_weights(FLAGS_output, *m.module, run.mesh->tp(), e.names, e.save);
  if (e.tokenizer_files.empty()) return std::to_string(n) + " tensors and config.json";
  engine::save_hf_tokenizer(FLAGS_output, e.tokenizer_files);
  return std::to_string(n) + " tensors, config.json and the tokenizer (" + e.tokenizer + ")";
}

// --format=torchscript: traced, loaded back and checked against the module on example inputs.
std::string export_torchscript(examples::ExampleModel& m, const std::string& model_name) {
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> inputs = m.inputs(m.synthetic_batch(FLAGS_example_rows));
  const at::Tensor want = m.forward(inputs);
  std::string type = model_name;
  type[0] = static_cast<char>(std::toupper(type[0]));
  const int64_t nodes = engine::trace_to_torchscript(*m.module, m.forward, inputs, type, FLAGS_output);
  const at::Tensor got = engine::run_torchscript(FLAGS_output, inputs);
  DTRAIN_CHECK(got.sizes() == want.sizes(), "the archive's output has shape ", got.sizes(), ", the module's ",
               want.sizes());
  const double diff = max_abs_difference(got, want);
  DTRAIN_CHECK(std::isfinite(diff) && diff <= 1e-5 * std::max(1.0, want.abs().max().item<double>()),
               "the archive written to ", FLAGS_output, " does not reproduce the module (max difference ", diff,
               "); please report this with the model flags");
  if (!FLAGS_write_example.empty()) write_example(inputs, want, model_name);
  char text[160];
  std::snprintf(text, sizeof text, "a traced graph of %lld nodes for inputs of shape", static_cast<long long>(nodes));
  std::string detail = text;
  for (const at::Tensor& t : inputs) {
    std::ostringstream shape;
    shape << t.sizes();
    detail += " " + shape.str();
  }
  std::snprintf(text, sizeof text, "; torch::jit::load reproduces the module within %.1e", diff);
  return detail + text;
}

int export_main(int argc, char** argv) {
  const std::string model_name = examples::flag_from_argv(argc, argv, "model", "gpt");
  engine::cli::describe_flags("Export", {"model", "checkpoint", "format", "output", "example_rows", "write_example",
                                         "quantize", "quantize_scales", "tokenizer", "bos"});
  std::map<std::string, std::string> defaults;  // the model's shape defaults (not its training ones)
  const std::vector<std::string> shape = examples::model_flag_names(model_name);
  for (const auto& [flag, value] : examples::model_flag_defaults(model_name)) {
    if (std::find(shape.begin(), shape.end(), flag) != shape.end()) defaults[flag] = value;
  }
  defaults["device"] = "cpu";  // the traced graph holds its device; export for the CPU unless asked
  // Only the device flags of the standard ones: export neither trains nor splits the model.
  examples::Run run = examples::init_run(argc, argv,
                                         "dtrain-export --model=mlp|cnn|seq2seq|gpt|llama [shape flags] --checkpoint=DIR "
                                         "--format=torchscript|safetensors|hf --output=FILE|DIR [--quantize=int8]",
                                         defaults, examples::model_checks(model_name),
                                         examples::model_flag_names(model_name), engine::cli::kRanks);
  check_export_flags(run);
  std::optional<engine::Tokenizer> tokenizer;
  if (!FLAGS_tokenizer.empty()) tokenizer = engine::Tokenizer::load(FLAGS_tokenizer);
  examples::ExampleModel m = examples::build_example_model(model_name, run);
  std::optional<HfExport> hf;
  if (FLAGS_format == "hf") hf = plan_hf_export(m, tokenizer ? &*tokenizer : nullptr);  // before the checkpoint
  const int64_t step = load_checkpoint(run, m);
  int64_t parameters = 0;
  std::set<const void*> counted;  // a tied weight (one tensor under two names) once
  for (const auto& p : m.module->parameters()) {
    if (counted.insert(p.data_ptr()).second) parameters += p.numel();
  }
  const std::string detail = FLAGS_format == "safetensors" ? export_safetensors(m, model_name, step)
                             : FLAGS_format == "hf"        ? export_hf(run, m, *hf)
                                                           : export_torchscript(m, model_name);
  std::printf("dtrain-export: wrote %s (%s, %s, %.3fM parameters) from the checkpoint of step %lld in %s\n",
              FLAGS_output.c_str(), FLAGS_format.c_str(), detail.c_str(), parameters / 1e6,
              static_cast<long long>(step), FLAGS_checkpoint.c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::guarded_main("dtrain-export", [&] { return export_main(argc, argv); });
}
