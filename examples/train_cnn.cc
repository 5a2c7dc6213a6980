// train_cnn: a small convolutional network on 8x8 images (scikit-learn's digits by default,
// --data=synthetic for random images with a linear-teacher label).
#include <torch/nn/functional/loss.h>

#include "cnn_model.h"
#include "common.h"
#include "datasets.h"
#include "model_factory.h"

using namespace dtrain;

int main(int argc, char** argv) {
  return examples::guarded_main("train_cnn", [&] {
    examples::Run run = examples::init_run(argc, argv, "train_cnn [flags]: CNN on 8x8 images",
                                           examples::model_flag_defaults("cnn"), nullptr,
                                           examples::model_flag_names("cnn"));
    examples::ClassificationData data = examples::classification_data();
    torch::manual_seed(engine::cli::flags().seed);
    auto model = std::make_shared<examples::ConvNet>(FLAGS_hidden, FLAGS_inplace, engine::cli::flags().checkpoint_activations);
    model->to(run.device);
    engine::TrainerOptions options = examples::trainer_options(run, "adamw");
    options.eval_loss_and_correct = [&](const engine::Batch& b) {  // eval_accuracy
      return examples::loss_and_correct(model->forward(b.fields[0]), b.fields[1]);
    };
    engine::Trainer trainer(*model, [&](const engine::Batch& b) {
      return torch::nn::functional::cross_entropy(model->forward(b.fields[0]), b.fields[1]);
    }, *run.mesh, run.device, options);
    engine::DataLoader train_loader(data.train, examples::loader_options(run, engine::cli::flags().batch_size, true, engine::cli::flags().seed));
    auto eval_loader = examples::eval_loader(run, data);
    examples::fit_and_report(run, trainer, *model, train_loader, eval_loader.get());
    return 0;
  });
}
