// train_gpt: a GPT-style decoder language model, GPT-2 small shape by default (12 pre-norm
// blocks, d 768, 12 heads, sequence 1024, vocabulary 32000, untied head, AdamW, no dropout).
// --tp=T splits attention heads, the MLP and the vocabulary over T consecutive ranks
// (Megatron-style); the remaining factor of the world is data-parallel. By default it
// learns the license texts Debian ships (bytes as tokens); --data=synthetic uses random
// tokens.
//   dtrain-run -np 4 -- train_gpt --tp=2 --d_model=64 --heads=4 --layers=2 --seq_len=32 --vocab=96
#include <cmath>

#include <glog/logging.h>

#include "common.h"
#include "datasets.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/offload.h"
#include "gpt_model.h"

using namespace dtrain;

int main(int argc, char** argv) {
  return examples::guarded_main("train_gpt", [&] {
    examples::Run run = examples::init_run(
        argc, argv, "train_gpt [flags]: GPT language model with tensor parallelism",
        {{"lr", "0.0006"}, {"batch_size", "8"}, {"steps", "100"}, {"d_model", "768"},
         {"heads", "12"}, {"layers", "12"}, {"ff", "3072"}, {"seq_len", "1024"},
         {"dropout", "0"}, {"weight_decay", "0.1"}, {"clip_grad_norm", "1.0"}},
        [] {
          // Shapes against --tp, before any collective.
          const int64_t T = FLAGS_tp;
          DTRAIN_CHECK(FLAGS_heads % T == 0, "--heads=", FLAGS_heads, " does not divide over --tp=", T,
                       "; the number of heads must be a multiple of the tensor-parallel size");
          DTRAIN_CHECK(FLAGS_ff % T == 0, "--ff=", FLAGS_ff, " does not divide over --tp=", T,
                       "; the feed-forward width must be a multiple of the tensor-parallel size");
          DTRAIN_CHECK(FLAGS_dropout == 0 || T == 1, "--dropout with --tp > 1 is not supported; "
                       "use --dropout=0 (the default for train_gpt)");
        });
    const int64_t S = FLAGS_seq_len;
    std::shared_ptr<engine::Dataset> data = examples::token_data(run, S, /*fold_bytes=*/true);
    examples::GptOptions mo;
    mo.vocab = FLAGS_vocab;
    mo.d_model = FLAGS_d_model;
    mo.heads = FLAGS_heads;
    mo.ff = FLAGS_ff;
    mo.layers = FLAGS_layers;
    mo.seq_len = S;
    mo.dropout = FLAGS_dropout;
    mo.checkpoint_activations = FLAGS_checkpoint_activations;
    torch::manual_seed(FLAGS_seed);  // the same full weights on every rank, for any --tp
    examples::Gpt model(mo, run.mesh->tp());
    model->to(run.device);
    if (engine::parse_offload(FLAGS_offload).layers) model->offload_blocks(run.device);
    if (run.world.rank == 0) {
      LOG(INFO) << "GPT with " << model->parameter_count() / 1e6 << "M parameters, tp "
                << run.mesh->tp_size() << ", dp " << run.mesh->dp_size();
    }
    engine::TrainerOptions options = examples::trainer_options(run, "adamw");
    options.optimizer.beta2 = 0.95;
    options.tokens_per_sample = S;
    engine::Trainer trainer(*model, [&](const engine::Batch& b) {
      const at::Tensor& w = b.fields[0];  // [B, S+1]
      return model->loss(w.narrow(1, 0, S), w.narrow(1, 1, S));
    }, *run.mesh, run.device, options);
    engine::DataLoader loader(data, examples::loader_options(run, FLAGS_batch_size, true, FLAGS_seed));
    engine::StepMetrics last = examples::fit_and_report(run, trainer, loader, nullptr);
    if (run.world.rank == 0 && run.device.is_cuda() && last.step_ms > 0) {
      // Model FLOPs per token: 6 N for the weights plus attention's 12 L d T (forward+backward).
      double flops_per_token = 6.0 * model->parameter_count() + 12.0 * mo.layers * mo.d_model * S;
      double tokens_per_s = last.samples_per_s * S;
      std::printf("train_gpt: %.1f TFLOP/s model FLOPs (MFU %.1f%% of 989 TFLOP/s dense bf16)\n",
                  flops_per_token * tokens_per_s / 1e12, 100 * flops_per_token * tokens_per_s / 989e12);
    }
    return 0;
  });
}
