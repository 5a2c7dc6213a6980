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
    at::Tensor x, y;
    if (FLAGS_data == "synthetic") {
      std::tie(x, y) = examples::synthetic_classification(4096, 64, 10, 1234);
    } else {
      std::tie(x, y) = examples::load_digits(
          FLAGS_data_path.empty() ? examples::sklearn_data_dir() + "/digits.csv.gz" : FLAGS_data_path);
    }
    const int64_t classes = 10;
    // Hold out the last 20% for evaluation.
    const int64_t n_eval = x.size(0) / 5, n_train = x.size(0) - n_eval;
    auto train = std::make_shared<engine::TensorDataset>(
        std::vector<at::Tensor>{x.narrow(0, 0, n_train), y.narrow(0, 0, n_train)});
    auto eval = std::make_shared<engine::TensorDataset>(
        std::vector<at::Tensor>{x.narrow(0, n_train, n_eval), y.narrow(0, n_train, n_eval)});

    torch::manual_seed(FLAGS_seed);
    torch::nn::Sequential model;
    int64_t in = x.size(1);
    for (int d = 0; d < FLAGS_depth; ++d) {
      model->push_back(torch::nn::Linear(in, FLAGS_hidden));
      model->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(FLAGS_inplace)));
      in = FLAGS_hidden;
    }
    model->push_back(torch::nn::Linear(in, classes));
    model->to(run.device);

    engine::TrainerOptions options = examples::trainer_options(run, "adamw");
    engine::StepMetrics first;
    options.on_log = [&](const engine::StepMetrics& m) { if (first.step == 0) first = m; };
    engine::Trainer trainer(*model, [&](const engine::Batch& b) {
      return torch::nn::functional::cross_entropy(model->forward(b.fields[0]), b.fields[1]);
    }, *run.mesh, run.device, options);

    engine::DataLoader train_loader(train, examples::loader_options(run, FLAGS_batch_size, true, FLAGS_seed));
    int64_t eval_batch = std::max<int64_t>(1, std::min<int64_t>(FLAGS_batch_size, n_eval / run.mesh->dp_size()));
    engine::DataLoader eval_loader(eval, examples::loader_options(run, eval_batch, false, FLAGS_seed));
    examples::fit_and_report(run, trainer, train_loader, &eval_loader, first);
    return 0;
  });
}
