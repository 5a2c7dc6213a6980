#include "common.h"

#include "datasets.h"
#include "distill.h"
#include "model_factory.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <glog/logging.h>
#include <torch/utils.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/logging.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/parallel/quantize.h"
#include "dtrain/engine/data/token_shards.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/train/cli.h"

// The examples' own flags; the standard ones are dtrain's (dtrain/engine/train/cli.h).
DEFINE_string(data, "real", "real (files that installed packages ship), synthetic, or tokens (language models: pre-tokenized shards at --data_path)");
DEFINE_string(data_path, "", "data file or directory (default: the example's); --data=tokens: shard files, directories, glob patterns or Megatron prefixes, separated by commas");
DEFINE_string(data_format, "auto", "--data=tokens: auto (llm.c shards by their magic, Megatron .idx/.bin pairs), llmc, megatron, raw (nanoGPT's headerless uint16) or raw32 (uint32)");
DEFINE_string(eval_data_path, "", "--data=tokens: held-out shards to evaluate on (as --data_path); none: no evaluation");
DEFINE_bool(inplace, true, "in-place activations where safe");
DEFINE_bool(eval_only, false, "only evaluate the --eval_samples held-out set under no_grad (memory/speed of inference)");
DEFINE_string(quantize, "", "int8: dynamic int8 Linear layers (CPU): --eval_only evaluates them beside float32, dtrain-export writes them");
DEFINE_string(quantize_scales, "channel", "int8 weight scales: channel (one per output feature) or tensor (one per weight)");
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
DEFINE_bool(sparse_embedding, false, "transformers: sparse token-embedding gradients (only the rows a batch touched travel and update)");
DEFINE_int64(kv_heads, 0, "llama: key/value heads (grouped-query attention when fewer than --heads; 0: --heads)");
DEFINE_double(rope_theta, 10000, "llama: the rotary position embedding's base");
DEFINE_bool(tie_embeddings, false, "gpt, llama: the output head shares the token embedding's weight (GPT-2's layout)");
DEFINE_string(hf_config, "", "gpt, llama: a Hugging Face config.json (GPT-2 or Llama) that gives the model's shape (--vocab, --d_model, --heads, --kv_heads, --ff, --layers, --rope_theta, --tie_embeddings follow it)");
DEFINE_string(init_from_hf, "", "gpt, llama: start from the weights of a Hugging Face checkpoint (a directory with model.safetensors or model.safetensors.index.json; give its config.json as --hf_config)");

namespace dtrain::examples {

void check_quantize_flags(bool evaluating, const char* how) {
  if (FLAGS_quantize.empty()) return;
  DTRAIN_CHECK(FLAGS_quantize == "int8", "--quantize=", FLAGS_quantize, " is not supported; use --quantize=int8 "
               "(dynamic int8 Linear layers) or leave it out");
  engine::parse_quant_granularity(FLAGS_quantize_scales);
  DTRAIN_CHECK(evaluating, "--quantize=int8 is for evaluation and export, not training (int8 weights have no "
               "gradients): add ", how, " (with --resume to use a checkpoint), or drop --quantize");
  DTRAIN_CHECK(engine::cli::flags().tp == 1, "--quantize=int8 with --tp=", engine::cli::flags().tp, ": quantize "
               "on one process (a tensor-parallel checkpoint is gathered when one process loads it); drop --tp");
  DTRAIN_CHECK(engine::cli::flags().amp == "off", "--quantize=int8 with --amp=", engine::cli::flags().amp,
               ": the int8 Linear takes float32 activations; drop --amp");
  DTRAIN_CHECK(engine::cli::flags().offload == "none", "--quantize=int8 with --offload=", engine::cli::flags().offload,
               ": the int8 model is evaluated in host memory already; drop --offload");
  DTRAIN_CHECK(engine::cli::flags().device != "cuda", "--quantize=int8 runs on the CPU (libtorch's dynamic int8 "
               "Linear, quantized::linear_dynamic, has CPU kernels only); use --device=cpu");
}

namespace {

// The examples' own flags (the standard ones are checked by cli::parse).
void check_flags(unsigned topics) {
  DTRAIN_CHECK(FLAGS_data == "real" || FLAGS_data == "synthetic" || FLAGS_data == "tokens", "--data=", FLAGS_data,
               " is not one of: real, synthetic, tokens");
  DTRAIN_CHECK(FLAGS_hidden >= 1 && FLAGS_depth >= 0 && FLAGS_d_model >= 1 && FLAGS_heads >= 1 &&
                   FLAGS_layers >= 1 && FLAGS_ff >= 1 && FLAGS_seq_len >= 1 && FLAGS_vocab >= 2,
               "model sizes must be positive (--hidden, --depth, --d_model, --heads, --layers, "
               "--ff, --seq_len, --vocab)");
  DTRAIN_CHECK(FLAGS_d_model % FLAGS_heads == 0, "--d_model=", FLAGS_d_model,
               " is not divisible by --heads=", FLAGS_heads);
  DTRAIN_CHECK(FLAGS_dropout >= 0 && FLAGS_dropout < 1, "--dropout=", FLAGS_dropout,
               " must be in [0, 1)");
  // A program without the training flags (dtrain-export) only evaluates or exports.
  check_quantize_flags(FLAGS_eval_only || !(topics & engine::cli::kTraining), "--eval_only");
  check_distill_flags(FLAGS_eval_only || !(topics & engine::cli::kTraining));
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

Run init_run(int argc, char** argv, const std::string& usage,
             const std::map<std::string, std::string>& defaults,
             const std::function<void()>& model_checks, const std::vector<std::string>& model_flags,
             unsigned topics) {
  // The standard flags (tensor parallelism only for programs with tensor-parallel layers), the
  // program's model shape, and the data flags every example has. Distillation and quantized
  // evaluation are the example trainers' (train_*); dtrain-export lists --quantize itself.
  std::string argv0 = argv[0];
  const std::string program = argv0.substr(argv0.rfind('/') == std::string::npos ? 0 : argv0.rfind('/') + 1);
  const bool trainer = program.rfind("train_", 0) == 0;
  if (trainer) {  // listed with the training flags
    engine::cli::describe_flags("Training", {"teacher", "distill_temperature", "distill_alpha", "teacher_bf16",
                                              "teacher_offload"});
  }
  std::vector<std::string> model_listed = model_flags;
  // The GPT's and the seq2seq's token embeddings (the Llama refuses sparse gradients).
  if (std::find(model_flags.begin(), model_flags.end(), "vocab") != model_flags.end() &&
      std::find(model_flags.begin(), model_flags.end(), "kv_heads") == model_flags.end()) {
    model_listed.push_back("sparse_embedding");
  }
  engine::cli::describe_flags("Model", model_listed);
  std::vector<std::string> data = {"data", "data_path", "data_format", "eval_data_path", "eval_only", "inplace"};
  if (trainer) data.insert(data.begin() + 5, {"quantize", "quantize_scales"});
  engine::cli::describe_flags("Data and evaluation", data, {"data_path"});  // joins --workers etc.
  if (!model_checks) topics &= ~engine::cli::kTensorParallel;
  engine::cli::parse(argc, argv, usage, topics, defaults);
  // The library's run set-up from the flags (engine/train/run.h); the examples' own checks run
  // before any communicator exists.
  engine::RunOptions ro = engine::cli::run_options(engine::cli::flags());
  ro.applies_plan = true;  // plan_and_apply (model_factory.cc)
  ro.checks = [&] {
    for (const char* flag : {"kv_heads", "rope_theta", "tie_embeddings", "hf_config", "init_from_hf"}) {
      gflags::CommandLineFlagInfo info;
      gflags::GetCommandLineFlagInfo(flag, &info);
      DTRAIN_CHECK(info.is_default || std::find(model_flags.begin(), model_flags.end(), flag) != model_flags.end(),
                   "--", flag, " is a flag of train_gpt's ",
                   std::string(flag) == "kv_heads" || std::string(flag) == "rope_theta" ? "Llama (--model=llama)"
                                                                                         : "language models (--model=gpt or llama)",
                   "; drop --", flag, " here");
    }
    apply_hf_config();  // the shape flags from a Hugging Face config.json, before they are checked
    check_flags(topics);
    check_writable_file(engine::cli::flags().metrics, "metrics");
    check_writable_file(engine::cli::flags().timeline, "timeline");
    engine::OffloadChoice offload = engine::parse_offload(engine::cli::flags().offload);
    DTRAIN_CHECK(!offload.layers || model_checks, "--offload=", engine::cli::flags().offload, ": ", program,
                 " has no offloadable layers (train_gpt streams its blocks); use --offload=optimizer");
    DTRAIN_CHECK(!(offload.layers && offload.optimizer) || engine::cli::flags().tp == 1,
                 "--offload=all needs --tp=1 (use --offload=layers or optimizer with tensor parallelism)");
    DTRAIN_CHECK(model_checks || engine::cli::flags().tp == 1, "--tp=", engine::cli::flags().tp, ": ", program,
                 " has no tensor-parallel layers; use train_gpt for tensor parallelism");
    DTRAIN_CHECK(model_checks || !engine::cli::flags().sequence_parallel, "--sequence_parallel: ", program,
                 " has no tensor-parallel layers; use train_gpt for sequence parallelism");
    if (model_checks) model_checks();
    engine::parse_amp(engine::cli::flags().amp);  // validates
  };
  engine::Run started = engine::start_run(ro, argv[0], program);
  Run run;
  run.model_flags = model_flags;
  run.program = program;
  run.world = started.world;
  run.device = started.device;
  run.comm = std::move(started.comm);
  run.mesh = std::move(started.mesh);
  return run;
}

std::pair<at::Tensor, at::Tensor> loss_and_correct(const at::Tensor& logits, const at::Tensor& labels) {
  at::Tensor loss = at::cross_entropy_loss(logits, labels);
  at::Tensor correct = logits.argmax(1).eq(labels).sum();
  return {loss, correct};
}

std::map<std::string, std::string> shape_meta(const Run& run) {
  std::map<std::string, std::string> meta;
  for (const std::string& flag : run.model_flags) {
    if (flag == "hf_config" || flag == "init_from_hf") continue;  // where the shape came from, not the shape
    // Free to change between runs of one model: the training length (a Llama's positions are
    // rotary; a GPT's table shows its size in a tensor) and dropout.
    const bool free = flag == "seq_len" || flag == "dropout";
    meta[(free ? "run." : "shape.") + flag] = gflags::GetCommandLineFlagInfoOrDie(flag.c_str()).current_value;
  }
  return meta;
}

engine::TrainerOptions trainer_options(const Run& run, const std::string& default_optimizer) {
  engine::TrainerOptions o = engine::cli::trainer_options(engine::cli::flags(), default_optimizer, run.mesh->tp_size());
  o.checkpoint_meta["program"] = run.program;
  o.model_applies_block_techniques = true;  // the example models checkpoint and stream their blocks
  // The model's shape, so that a later run can rebuild it (a distillation teacher's defaults)
  // and a resume, an evaluation, generation or an export refuses other shape flags.
  for (const auto& [key, value] : shape_meta(run)) o.checkpoint_meta[key] = value;
  o.evaluation_only = FLAGS_eval_only;  // no optimizer state or gradient buffers to evaluate
  return o;
}

engine::LoaderOptions loader_options(const Run& run, int64_t batch_size, bool shuffle, uint64_t seed) {
  engine::LoaderOptions o = engine::cli::loader_options(engine::cli::flags(), batch_size, run.device, shuffle);
  o.seed = seed;
  return o;
}

void report(const Run& run, const engine::StepMetrics& first, const engine::StepMetrics& last) {
  if (run.world.rank != 0) return;
  std::string evaluation;
  if (last.eval_loss) {
    char text[128];
    auto accuracy = last.extra.find("eval_accuracy"), perplexity = last.extra.find("eval_perplexity");
    if (accuracy != last.extra.end()) {
      std::snprintf(text, sizeof(text), "; eval loss %.4f, accuracy %.1f%%", *last.eval_loss, 100 * accuracy->second);
    } else if (perplexity != last.extra.end()) {
      std::snprintf(text, sizeof(text), "; eval loss %.4f, perplexity %.2f", *last.eval_loss, perplexity->second);
    } else {
      std::snprintf(text, sizeof(text), "; eval loss %.4f", *last.eval_loss);
    }
    evaluation = text;
  }
  // A resumed run trained from its checkpoint's step on; the times are the last logged window's.
  const std::string trained = first.step <= 1 ? std::to_string(last.step) + " steps"
                                              : "steps " + std::to_string(first.step) + "-" + std::to_string(last.step) +
                                                    " (resumed)";
  std::printf("%s: trained %s on %d rank(s): loss %.4f (step %lld) -> %.4f (step %lld), "
              "%.1f ms/step, %.0f samples/s (the last logged steps), peak memory %.0f MiB%s\n",
              run.program.c_str(), trained.c_str(), run.world.size, first.loss, static_cast<long long>(first.step),
              last.loss, static_cast<long long>(last.step), last.step_ms, last.samples_per_s, last.mem_peak_mb,
              evaluation.c_str());
  std::fflush(stdout);
}

engine::StepMetrics fit_and_report(const Run& run, engine::Trainer& trainer, torch::nn::Module& model,
                                   engine::DataLoader& train, engine::DataLoader* eval) {
  if (!FLAGS_eval_only) {
    DTRAIN_CHECK(engine::cli::flags().eval_every == 0 || eval, run.program, " has no held-out data to evaluate on; drop --eval_every");
    engine::StepMetrics last = trainer.fit(train, engine::cli::flags().eval_every > 0 ? eval : nullptr);
    engine::cli::exit_if_preempted(trainer, run.program, run.world.rank);
    if (trainer.first_logged().step == 0) {
      // Resumed a run that had already reached --steps: nothing was trained, nothing to report.
      if (run.world.rank == 0) {
        const std::string& dir = engine::cli::flags().save_dir;
        std::printf("%s: the run is already complete (step %lld of --steps=%lld%s); nothing to train\n",
                    run.program.c_str(), static_cast<long long>(trainer.current_step()),
                    static_cast<long long>(engine::cli::flags().steps),
                    dir.empty() ? "" : (", checkpoint in " + dir).c_str());
        std::fflush(stdout);
      }
      return last;
    }
    report(run, trainer.first_logged(), last);
    return last;
  }
  // Without held-out data (no --eval_data_path) the training samples are scored, and said so.
  engine::DataLoader& data = eval ? *eval : train;
  const char* kind = eval ? "held-out samples" : "training samples (not held out: no --eval_data_path)";
  const engine::ResumeMode resume = engine::parse_resume(engine::cli::flags().resume);
  const std::string& dir = engine::cli::flags().save_dir;
  if (resume != engine::ResumeMode::kNo) {  // evaluate a checkpoint's weights
    if (trainer.resume_checkpoint(nullptr, resume == engine::ResumeMode::kYes) && run.world.rank == 0) {
      std::printf("%s: evaluating the checkpoint of step %lld in %s\n", run.program.c_str(),
                  static_cast<long long>(trainer.current_step()), dir.c_str());
    }
  } else {
    // A directory of checkpoints without --resume: the user means them, and would get the
    // model's initial weights scored (a training run refuses the same directory).
    DTRAIN_CHECK(dir.empty() || engine::CheckpointStore(dir).list().empty(), "--eval_only --save_dir=", dir,
                 ": the directory holds checkpoints, but without --resume the model's initial weights would be "
                 "evaluated; add --resume to evaluate the newest checkpoint");
    gflags::CommandLineFlagInfo hf;
    const bool from_hf = gflags::GetCommandLineFlagInfo("init_from_hf", &hf) && !hf.current_value.empty();
    if (run.world.rank == 0) {
      std::printf("%s: evaluating %s\n", run.program.c_str(),
                  from_hf ? ("the weights of --init_from_hf=" + hf.current_value).c_str()
                          : "the model's initial weights (no checkpoint: --resume --save_dir=DIR evaluates one)");
    }
  }
  // The held-out set of --eval_samples (the same samples for any rank count), in forwards of
  // the loader's batch: timed as a whole after one warm-up forward.
  const int64_t samples = static_cast<int64_t>(data.evaluation_order(engine::cli::flags().eval_samples).size());
  const int64_t chunks = (samples + data.options().batch_size - 1) / data.options().batch_size;
  const int64_t forwards = (chunks + run.mesh->dp_size() - 1) / run.mesh->dp_size();
  auto evaluate = [&](const char* what) {
    trainer.evaluate(data, 1);  // warm-up
    engine::reset_peak_memory(run.device);
    auto t0 = std::chrono::steady_clock::now();
    double loss = trainer.evaluate(data);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / forwards;
    engine::MemoryStats mem = engine::memory_stats(run.device);
    if (run.world.rank == 0) {
      std::printf("%s: evaluated %lld %s (%lld batches per rank) under no_grad%s: loss %.4f, %.1f "
                  "ms/batch, peak memory %.0f MiB\n",
                  run.program.c_str(), static_cast<long long>(samples), kind, static_cast<long long>(forwards), what,
                  loss, ms, mem.peak_mb);
    }
    return std::make_pair(loss, ms);
  };
  if (FLAGS_quantize.empty()) {
    evaluate("");
    return engine::StepMetrics();
  }
  // The same samples in float32 and then with int8 Linear layers, for the comparison.
  const auto [float_loss, float_ms] = evaluate(" in float32");
  engine::QuantizeOptions q;
  q.granularity = engine::parse_quant_granularity(FLAGS_quantize_scales);
  const engine::QuantizeReport report = engine::quantize_dynamic_int8(model, q);
  const auto [int8_loss, int8_ms] = evaluate(" with int8 Linear layers");
  if (run.world.rank == 0) {
    std::printf("%s: %s (%s scales); eval loss %+.4f (%+.2f%%), %.2fx the float32 time per batch\n",
                run.program.c_str(), report.summary().c_str(), FLAGS_quantize_scales.c_str(), int8_loss - float_loss,
                100 * (int8_loss - float_loss) / std::max(1e-12, std::abs(float_loss)), int8_ms / float_ms);
    std::fflush(stdout);
  }
  return engine::StepMetrics();
}

ClassificationData classification_data() {
  DTRAIN_CHECK(FLAGS_data != "tokens", "--data=tokens is for the language models (train_gpt, train_seq2seq); use "
               "--data=real or synthetic");
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
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(engine::cli::flags().batch_size, data->size() / run.mesh->dp_size()));
  return std::make_unique<engine::DataLoader>(std::move(data), loader_options(run, rows, false, engine::cli::flags().seed));
}

}  // namespace

std::unique_ptr<engine::DataLoader> eval_loader(const Run& run, const ClassificationData& data) {
  return held_out_loader(run, data.eval);
}

int train_digits_classifier(int argc, char** argv, const char* program, const std::string& model,
                            const std::string& usage) {
  return guarded_main(program, [&] {
    Run run = init_run(argc, argv, usage, model_flag_defaults(model), nullptr, model_flag_names(model));
    ClassificationData data = classification_data();
    ExampleModel m = build_example_model(model, run);
    attach_teacher(run, m);  // --teacher: distillation
    engine::TrainerOptions options = trainer_options(run, m.default_optimizer);
    options.eval_loss_and_correct = m.eval_loss_and_correct;  // eval_accuracy
    plan_and_apply(run, m, options);
    engine::Trainer trainer(*m.module, m.loss, *run.mesh, run.device, options);
    engine::DataLoader train_loader(data.train, loader_options(run, engine::cli::flags().batch_size, true, engine::cli::flags().seed));
    auto eval = eval_loader(run, data);
    fit_and_report(run, trainer, *m.module, train_loader, eval.get());
    return 0;
  });
}

std::unique_ptr<engine::DataLoader> eval_loader(const Run& run, const TokenData& data) {
  return data.eval ? held_out_loader(run, data.eval) : nullptr;
}

namespace {

std::shared_ptr<engine::TokenShardDataset> token_shards(const Run& run, const std::string& paths, const char* flag,
                                                        int64_t window_len) {
  engine::TokenShardOptions o;
  std::stringstream list(paths);
  for (std::string item; std::getline(list, item, ',');) {
    if (!item.empty()) o.paths.push_back(item);
  }
  DTRAIN_CHECK(!o.paths.empty(), "--data=tokens needs ", flag, ": the token shards (files, directories, globs)");
  o.format = FLAGS_data_format == "raw32" ? engine::TokenFormat::kRaw : engine::parse_token_format(FLAGS_data_format);
  o.raw_token_bytes = FLAGS_data_format == "raw32" ? 4 : 2;
  o.seq_len = window_len;  // windows of window_len + 1 tokens, as TokenWindows'
  o.vocab = FLAGS_vocab;
  auto data = std::make_shared<engine::TokenShardDataset>(o);
  if (run.world.rank == 0) LOG(INFO) << flag << ": " << data->describe();
  return data;
}

// The held-out shards kept out of training: a directory given as --data_path must not hold a
// validation shard (dtrain-prepare and llm.c write PREFIX_val_*.bin beside the train shards),
// and no shard may be in both sets. Either way the evaluation would score trained-on windows.
void check_held_out(const engine::TokenShardDataset& train, const engine::TokenShardDataset* eval) {
  std::stringstream list(FLAGS_data_path);
  for (std::string item; std::getline(list, item, ',');) {
    struct stat st {};
    if (item.empty() || ::stat(item.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    const std::string prefix = item.back() == '/' ? item : item + "/";  // the directory's shards
    for (const engine::TokenShardInfo& shard : train.shards()) {
      const std::string name = shard.path.substr(shard.path.rfind('/') + 1);
      DTRAIN_CHECK(shard.path.rfind(prefix, 0) != 0 || name.find("_val_") == std::string::npos, "--data_path=", item,
                   " holds ", name, ", a validation shard (dtrain-prepare's and llm.c's PREFIX_val_*.bin): training "
                   "on it makes the evaluation score trained-on text. Name the training shards with a pattern, e.g. "
                   "--data_path='", item, "/*_train_*.bin', and the validation shard with --eval_data_path");
    }
  }
  if (eval == nullptr) return;
  const auto real = [](const std::string& path) {
    char* r = ::realpath(path.c_str(), nullptr);
    std::string out = r ? r : path;
    std::free(r);
    return out;
  };
  std::set<std::string> trained;
  for (const engine::TokenShardInfo& shard : train.shards()) trained.insert(real(shard.path));
  for (const engine::TokenShardInfo& shard : eval->shards()) {
    DTRAIN_CHECK(!trained.count(real(shard.path)), "--eval_data_path's shard ", shard.path, " is also in --data_path: "
                 "the evaluation would score text the model trains on; keep the held-out shards out of --data_path");
  }
}

}  // namespace

TokenData token_data(const Run& run, int64_t window_len, bool fold_bytes) {
  if (FLAGS_data == "tokens") {
    TokenData d;
    auto train = token_shards(run, FLAGS_data_path, "--data_path", window_len);
    std::shared_ptr<engine::TokenShardDataset> eval;
    if (!FLAGS_eval_data_path.empty()) eval = token_shards(run, FLAGS_eval_data_path, "--eval_data_path", window_len);
    check_held_out(*train, eval.get());
    d.train = train;
    d.eval = eval;
    return d;
  }
  DTRAIN_CHECK(FLAGS_eval_data_path.empty() && FLAGS_data_format == "auto", "--eval_data_path and --data_format are "
               "for --data=tokens");
  if (FLAGS_data == "synthetic") {
    const int64_t count = std::max<int64_t>(1024, 4 * engine::cli::flags().batch_size * run.world.size);
    return {synthetic_tokens(count, window_len, FLAGS_vocab, 4321),
            synthetic_tokens(std::max<int64_t>(64, engine::cli::flags().batch_size * run.world.size), window_len, FLAGS_vocab,
                             8765)};
  }
  DTRAIN_CHECK(fold_bytes || FLAGS_vocab >= 256, "--vocab=", FLAGS_vocab,
               " is too small for byte tokens of the text corpus (needs >= 256)");
  const std::string path = FLAGS_data_path.empty() ? text_corpus_dir() : FLAGS_data_path;
  at::Tensor bytes = load_text_bytes(path);
  if (FLAGS_vocab < 256) {
    // Said out loud: distinct bytes then share a token, so the model cannot tell them apart.
    const int64_t distinct = std::get<0>(at::_unique(bytes)).numel();
    const int64_t classes = std::get<0>(at::_unique(at::remainder(bytes.to(at::kLong), FLAGS_vocab))).numel();
    if (run.world.rank == 0) {
      std::fprintf(stderr,
                   "%s: --vocab=%lld is below 256: each byte b of the corpus becomes token b mod %lld, so its %lld "
                   "distinct bytes fall into %lld tokens%s; use --vocab=256 to keep every byte apart\n",
                   run.program.c_str(), static_cast<long long>(FLAGS_vocab), static_cast<long long>(FLAGS_vocab),
                   static_cast<long long>(distinct), static_cast<long long>(classes),
                   classes < distinct ? " (some share one)" : "");
    }
    bytes = at::remainder(bytes.to(at::kLong), FLAGS_vocab);
  }
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
