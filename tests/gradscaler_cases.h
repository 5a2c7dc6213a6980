// The loss scaler's test inputs against tests/reference/gradscaler_reference.py, shared by the
// CPU (tests/unit/amp_test.cc) and CUDA (tests/gpu/amp_gpu_test.cc) tests.
#pragma once

#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

namespace dtrain::engine::gradscaler_cases {

// The gradients the reference plants at step k (see its docstring) on `device`, times `scale`;
// index 2 undefined.
inline std::vector<at::Tensor> planted_grads(int k, double scale, bool inf, bool nan,
                                             c10::Device device = c10::Device(c10::kCPU)) {
  at::Tensor g0 = (at::arange(5, at::kFloat) - 2) * 0.25 + k * 0.125;
  at::Tensor g1 = at::arange(6, at::kDouble).reshape({2, 3}) * 0.5 - 1 + k * 0.0625;
  at::Tensor g3 = (at::arange(4, at::kFloat) * 0.5 - 0.75 + k * 0.125).to(at::kBFloat16);
  g0 = (g0 * scale).to(device);
  g1 = (g1 * scale).to(device);
  g3 = (g3 * scale).to(device);
  if (inf) {
    g0[1] = std::numeric_limits<float>::infinity();
    g3[2] = -std::numeric_limits<float>::infinity();
  }
  if (nan) g1[0][2] = std::numeric_limits<double>::quiet_NaN();
  return {g0, g1, at::Tensor(), g3};
}

// A JSON list of numbers from the reference as a CPU tensor of `dtype`.
inline at::Tensor from_json(const nlohmann::json& values, at::ScalarType dtype) {
  return at::tensor(values.get<std::vector<double>>(), at::kDouble).to(dtype);
}

}  // namespace dtrain::engine::gradscaler_cases
