// The example CNN (train_cnn, dtrain-export --model=cnn): two 3x3 convolutions with ReLU and
// 2x2 max pooling over 8x8 one-channel images, then two Linear layers to 10 classes.
#pragma once

#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include "dtrain/engine/parallel/quantize.h"

#include "dtrain/engine/memory/activation_checkpoint.h"

namespace dtrain::examples {

struct ConvNet : torch::nn::Module {
  explicit ConvNet(int64_t hidden, bool inplace, bool checkpoint) : inplace_(inplace), checkpoint_(checkpoint) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
    fc1 = register_module("fc1", engine::Linear(64 * 4 * 4, hidden));
    fc2 = register_module("fc2", engine::Linear(hidden, 10));
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
  engine::Linear fc1{nullptr}, fc2{nullptr};
  bool inplace_, checkpoint_;
};

}  // namespace dtrain::examples
