// train_mlp: a feed-forward classifier. By default it learns scikit-learn's 8x8 handwritten
// digits (64 pixels, 10 classes); --data=synthetic uses a random linear-teacher task.
//   train_mlp --steps=200 --batch_size=64
//   dtrain-run -np 2 -- train_mlp --batch_size=32          (same global batches as above)
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "common.h"
#include "datasets.h"

using namespace dtrain;

int main(int argc, char** argv) {
  return examples::guarded_main("train_mlp", [&] {
    examples::Run run = examples::init_run(argc, argv, "train_mlp [flags]: MLP classifier",
                                           {{"lr", "0.001"}, {"batch_size", "64"}, {"steps", "200"}});
    examples::ClassificationData data = examples::classification_data();
    torch::manual_seed(FLAGS_seed);
    torch::nn::Sequential model;
    int64_t in = data.features;
    for (int d = 0; d < FLAGS_depth; ++d) {
      model->push_back(torch::nn::Linear(in, FLAGS_hidden));
      model->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(FLAGS_inplace)));
      in = FLAGS_hidden;
    }
    model->push_back(torch::nn::Linear(in, data.classes));
    model->to(run.device);

    engine::TrainerOptions options = examples::trainer_options(run, "adamw");
    engine::Trainer trainer(*model, [&](const engine::Batch& b) {
      return torch::nn::functional::cross_entropy(model->forward(b.fields[0]), b.fields[1]);
    }, *run.mesh, run.device, options);

    engine::DataLoader train_loader(data.train, examples::loader_options(run, FLAGS_batch_size, true, FLAGS_seed));
    auto eval_loader = examples::eval_loader(run, data);
    examples::fit_and_report(run, trainer, train_loader, eval_loader.get());
    return 0;
  });
}
