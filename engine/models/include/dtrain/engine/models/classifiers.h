// Small classifiers of flat feature rows (train_mlp and train_cnn learn scikit-learn's 8x8
// digits with them: 64 pixels, 10 classes). No blocks: data parallelism, ZeRO-1/2 and optimizer
// offload apply; ConvNet also checkpoints its convolutions itself.
#pragma once

#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>

#include "dtrain/engine/parallel/quantize.h"

namespace dtrain::engine {

struct MlpOptions {
  int64_t in_features = 64, hidden = 256;
  int depth = 3;  // hidden layers
  int64_t classes = 10;
  bool inplace = true;  // in-place ReLU
};

// Linear, ReLU, ... Linear: depth hidden layers, then the classifier. A Sequential, so the
// parameter names are its indices ("0.weight", "0.bias", "2.weight", ...): checkpoints and
// recorded curves name them so.
torch::nn::Sequential make_mlp(const MlpOptions& o);

// Two 3x3 convolutions with ReLU and 2x2 max pooling over 8x8 one-channel images (rows of 64
// pixels), then two Linear layers to 10 classes. checkpoint: the convolutions recomputed in
// backward (in training).
struct ConvNet : torch::nn::Module {
  ConvNet(int64_t hidden, bool inplace, bool checkpoint);
  at::Tensor relu(at::Tensor x);
  at::Tensor features(const at::Tensor& x);
  at::Tensor forward(const at::Tensor& pixels);  // [N, 64] -> logits [N, 10]
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  Linear fc1{nullptr}, fc2{nullptr};
  bool inplace_, checkpoint_;
};

}  // namespace dtrain::engine
