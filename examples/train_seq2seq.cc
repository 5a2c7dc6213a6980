// train_seq2seq: the seed benchmark model (4 encoder + 4 decoder layers, d_model 512, 8 heads,
// feed-forward 2048, dropout 0.1, vocabulary 32000, source and target length 256, batch 16,
// Adagrad lr 0.01). By default it learns to continue text: the source is a window of the
// license texts Debian ships in /usr/share/common-licenses (bytes as tokens), the target the
// window that follows. --data=synthetic trains on random tokens (the benchmark's data).
#include "common.h"
#include "datasets.h"
#include "seq2seq_model.h"
#include "dtrain/dist/error.h"

using namespace dtrain;

int main(int argc, char** argv) {
  return examples::guarded_main("train_seq2seq", [&] {
    examples::Run run = examples::init_run(
        argc, argv, "train_seq2seq [flags]: encoder-decoder transformer",
        {{"lr", "0.01"}, {"batch_size", "16"}, {"steps", "100"}, {"seq_len", "256"}});
    const int64_t S = FLAGS_seq_len;
    std::shared_ptr<engine::Dataset> data = examples::token_data(run, 2 * S, /*fold_bytes=*/false);
    examples::Seq2SeqOptions mo;
    mo.vocab = FLAGS_vocab;
    mo.d_model = FLAGS_d_model;
    mo.heads = FLAGS_heads;
    mo.ff = FLAGS_ff;
    mo.layers = FLAGS_layers;
    mo.max_len = S;
    mo.dropout = FLAGS_dropout;
    mo.inplace = FLAGS_inplace;
    mo.checkpoint_activations = FLAGS_checkpoint_activations;
    torch::manual_seed(FLAGS_seed);
    examples::Seq2Seq model(mo);
    model->to(run.device);

    engine::TrainerOptions options = examples::trainer_options(run, "adagrad");
    options.tokens_per_sample = 2 * S;
    engine::Trainer trainer(*model, [&](const engine::Batch& b) {
      const at::Tensor& w = b.fields[0];  // [B, 2S+1]
      return model->loss(w.narrow(1, 0, S), w.narrow(1, S, S), w.narrow(1, S + 1, S));
    }, *run.mesh, run.device, options);
    engine::DataLoader loader(data, examples::loader_options(run, FLAGS_batch_size, true, FLAGS_seed));
    examples::fit_and_report(run, trainer, loader, nullptr);
    return 0;
  });
}
