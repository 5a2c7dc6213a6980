#include "dtrain/engine/models/classifiers.h"

#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/activation.h>

#include "dtrain/engine/memory/activation_checkpoint.h"

namespace dtrain::engine {

torch::nn::Sequential make_mlp(const MlpOptions& o) {
  torch::nn::Sequential model;
  int64_t in = o.in_features;
  for (int d = 0; d < o.depth; ++d) {
    model->push_back(Linear(in, o.hidden));
    model->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(o.inplace)));
    in = o.hidden;
  }
  model->push_back(Linear(in, o.classes));
  return model;
}

ConvNet::ConvNet(int64_t hidden, bool inplace, bool checkpoint) : inplace_(inplace), checkpoint_(checkpoint) {
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
  fc1 = register_module("fc1", Linear(64 * 4 * 4, hidden));
  fc2 = register_module("fc2", Linear(hidden, 10));
}

at::Tensor ConvNet::relu(at::Tensor x) { return inplace_ ? x.relu_() : x.relu(); }

at::Tensor ConvNet::features(const at::Tensor& x) {
  at::Tensor h = relu(conv1->forward(x));
  h = relu(conv2->forward(h));
  return torch::nn::functional::max_pool2d(h, torch::nn::functional::MaxPool2dFuncOptions(2));
}

at::Tensor ConvNet::forward(const at::Tensor& pixels) {
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

}  // namespace dtrain::engine
