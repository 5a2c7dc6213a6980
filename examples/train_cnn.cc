// train_cnn: a small convolutional network on 8x8 images (scikit-learn's digits by default,
// --data=synthetic for random images with a linear-teacher label).
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include "common.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "datasets.h"

using namespace dtrain;

struct ConvNet : torch::nn::Module {
  explicit ConvNet(int64_t hidden, bool inplace, bool checkpoint) : inplace_(inplace), checkpoint_(checkpoint) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(64 * 4 * 4, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 10));
  }
  at::Tensor relu(at::Tensor x) { return inplace_ ? x.relu_() : x.relu(); }
  at::Tensor features(const at::Tensor& x) {
    at::Tensor h = relu(conv1->forward(x));
    h = relu(conv2->forward(h));
    return torch::nn::functional::max_pool2d(h, torch::nn::functional::MaxPool2dFuncOptions(2));
  }
  at::Tensor forward(const at::Tensor& pixels) {
    at::Tensor x = pixels.view({-1, 1, 8, 8});
    at::Tensor h;
    if (checkpoint_ && is_training()) {
      std::vector<at::Tensor> params = {conv1->weight, conv1->bias, conv2->weight, conv2->bias};
      h = engine::checkpoint([this](const at::Tensor& in) { return features(in); }, x, params);
    } else {
      h = features(x);
    }
    return fc2->forward(relu(fc1->forward(h.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool inplace_, checkpoint_;
};

int main(int argc, char** argv) {
  return examples::guarded_main("train_cnn", [&] {
    examples::Run run = examples::init_run(argc, argv, "train_cnn [flags]: CNN on 8x8 images",
                                           {{"lr", "0.001"}, {"batch_size", "64"}, {"steps", "200"},
                                            {"hidden", "128"}},
                                           nullptr, {"hidden"});
    examples::ClassificationData data = examples::classification_data();
    torch::manual_seed(engine::cli::flags().seed);
    auto model = std::make_shared<ConvNet>(FLAGS_hidden, FLAGS_inplace, engine::cli::flags().checkpoint_activations);
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
    examples::fit_and_report(run, trainer, train_loader, eval_loader.get());
    return 0;
  });
}
