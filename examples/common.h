// Shared set-up of the example programs: the flags of ARCHITECTURE.md, the process world,
// communicators and mesh, and the trainer options built from the flags.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gflags/gflags.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/train/cli.h"
#include "dtrain/engine/train/trainer.h"

// The examples' own flags; the standard ones (--steps, --lr, ...) are engine::cli::flags().
DECLARE_string(data);
DECLARE_string(data_path);
DECLARE_bool(inplace);
DECLARE_bool(eval_only);
DECLARE_string(quantize);
DECLARE_string(quantize_scales);
// model shape
DECLARE_int64(hidden);
DECLARE_int32(depth);
DECLARE_int64(d_model);
DECLARE_int64(heads);
DECLARE_int32(layers);
DECLARE_int64(ff);
DECLARE_int64(seq_len);
DECLARE_int64(vocab);
DECLARE_double(dropout);
DECLARE_bool(sparse_embedding);
DECLARE_int64(kv_heads);
DECLARE_double(rope_theta);
DECLARE_bool(tie_embeddings);
DECLARE_string(hf_config);
DECLARE_string(init_from_hf);

namespace dtrain::examples {

// Everything a run needs from the environment, created in this order.
struct Run {
  dist::World world;
  c10::Device device{c10::kCPU};
  std::unique_ptr<dist::Communicator> comm;
  std::unique_ptr<dist::Mesh> mesh;
  std::string program;
  std::vector<std::string> model_flags;  // the model-shape flags the program reads
};

// Parses and validates the flags (dtrain::Error on bad values), detects the world, picks the
// device, creates the communicator and the data x tensor mesh, and seeds the RNGs.
// `defaults` overrides flag defaults for this program (before parsing), e.g. {"batch_size", "16"}.
// `model_checks` runs after the flags are validated and before any communicator exists
// (shape checks against --tp belong there); programs without it refuse --tp > 1.
// `model_flags`: the model-shape flags this program reads (--help lists them, every rank must
// agree on them). `topics`: the standard flags the program takes (engine::cli::Topic); the
// others keep their defaults and are not on its command line.
Run init_run(int argc, char** argv, const std::string& usage,
             const std::map<std::string, std::string>& defaults,
             const std::function<void()>& model_checks, const std::vector<std::string>& model_flags,
             unsigned topics = engine::cli::kAllTopics);

// A classifier's mean cross-entropy and number of correct predictions (argmax == label) of a
// batch, from its logits: TrainerOptions::eval_loss_and_correct.
std::pair<at::Tensor, at::Tensor> loss_and_correct(const at::Tensor& logits, const at::Tensor& labels);

// Trainer options from the flags; the example supplies its defaults for the optimizer.
engine::TrainerOptions trainer_options(const Run& run, const std::string& default_optimizer);
// The model's shape flags as a checkpoint records them: "shape.<flag>" (a checkpoint that
// recorded another value is refused by a resume and by engine::load_weights) and "run.<flag>"
// for --seq_len and --dropout, which may change between runs of one model.
std::map<std::string, std::string> shape_meta(const Run& run);
// Loader options for this rank (dp rank/size from the mesh) from the flags.
engine::LoaderOptions loader_options(const Run& run, int64_t batch_size, bool shuffle, uint64_t seed);

// dtrain's exit codes around a main function (engine::cli::run_main).
inline int guarded_main(const char* program, const std::function<int()>& body) {
  return engine::cli::run_main(program, body);
}

// Trains (or with --eval_only evaluates the --eval_samples held-out set under no_grad, timing it)
// and prints the summary on rank 0. eval may be null (then train's data is evaluated).
// Returns the last logged metrics (step 0 when only evaluating).
// With --quantize=int8 (only with --eval_only) the batches are evaluated in float32, then
// model's Linear layers are quantized (engine::quantize_dynamic_int8) and they are evaluated
// again: both losses and times, and the weight bytes, are printed.
engine::StepMetrics fit_and_report(const Run& run, engine::Trainer& trainer, torch::nn::Module& model,
                                   engine::DataLoader& train, engine::DataLoader* eval);

// Refuses --quantize values and combinations that cannot work (training, --tp > 1, --amp,
// --device=cuda); `evaluating` says whether the program evaluates or exports (else: `how`
// names the flag that would).
void check_quantize_flags(bool evaluating, const char* how);

// Classification data from the flags: scikit-learn's digits (or --data_path), or with
// --data=synthetic a learnable random task; the last 20% held out for evaluation.
struct ClassificationData {
  std::shared_ptr<engine::Dataset> train, eval;
  int64_t features = 0, classes = 10, eval_rows = 0;
};
ClassificationData classification_data();
// An evaluation loader whose per-rank batch fits the held-out rows.
std::unique_ptr<engine::DataLoader> eval_loader(const Run& run, const ClassificationData& data);
// The whole program of train_mlp and train_cnn: the digits classifier `model` ("mlp", "cnn";
// build_example_model) trained on classification_data(), its accuracy evaluated on the held-out
// rows. `usage` heads --help.
int train_digits_classifier(int argc, char** argv, const char* program, const std::string& model,
                            const std::string& usage);

// Token windows from the flags: Debian's license texts as bytes (or --data_path), or random
// tokens with --data=synthetic. Each sample has window_len + 1 tokens. Byte tokens need a
// vocabulary of 256 unless fold_bytes (then bytes are taken modulo --vocab). The last 10% of
// the text (synthetic: other random tokens) is held out for evaluation.
struct TokenData {
  std::shared_ptr<engine::Dataset> train, eval;
};
TokenData token_data(const Run& run, int64_t window_len, bool fold_bytes);
// An evaluation loader over the held-out windows, its per-rank batch fitting them.
std::unique_ptr<engine::DataLoader> eval_loader(const Run& run, const TokenData& data);

// Prints the final summary line on rank 0.
void report(const Run& run, const engine::StepMetrics& first, const engine::StepMetrics& last);

// Default location of data that PyPI/Debian packages ship (sklearn's tables, license texts).
std::string sklearn_data_dir();
std::string text_corpus_dir();

}  // namespace dtrain::examples
