// train_seq2seq: the seed benchmark model (4 encoder + 4 decoder layers, d_model 512, 8 heads,
// feed-forward 2048, dropout 0.1, vocabulary 32000, source and target length 256, batch 16,
// Adagrad lr 0.01). By default it learns to continue text: the source is a window of the
// license texts Debian ships in /usr/share/common-licenses (bytes as tokens), the target the
// window that follows. --data=synthetic trains on random tokens (the benchmark's data).
#include "common.h"
#include "distill.h"
#include "model_factory.h"

using namespace dtrain;

int main(int argc, char** argv) {
  return examples::guarded_main("train_seq2seq", [&] {
    examples::Run run = examples::init_run(argc, argv, "train_seq2seq [flags]: encoder-decoder transformer",
                                           examples::model_flag_defaults("seq2seq"), nullptr,
                                           examples::model_flag_names("seq2seq"));
    const int64_t S = FLAGS_seq_len;
    examples::ExampleModel model = examples::build_example_model("seq2seq", run);
    examples::attach_teacher(run, model);  // --teacher: distillation
    engine::TrainerOptions options = examples::trainer_options(run, model.default_optimizer);
    options.eval_perplexity = true;
    options.tokens_per_sample = 2 * S;
    // The data first: where it lives on the device (a CPU run), --plan=auto counts it.
    examples::TokenData data = examples::token_data(run, 2 * S, /*fold_bytes=*/false);
    examples::plan_and_apply(run, model, options);
    engine::Trainer trainer(*model.module, model.loss, *run.mesh, run.device, options);
    engine::DataLoader loader(data.train, examples::loader_options(run, engine::cli::flags().batch_size, true, engine::cli::flags().seed));
    auto eval = examples::eval_loader(run, data);
    examples::fit_and_report(run, trainer, *model.module, loader, eval.get());
    return 0;
  });
}
