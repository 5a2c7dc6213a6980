// Device work for the GPU tests that need the device busy well after the host returned from
// queueing it (device-generic: no CUDA headers).
#pragma once

#include <chrono>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace dtrain::testing_util {

// Queues `count` float32 matrix products of n x n on the current stream of `device` and returns
// once they are queued (each takes milliseconds on the device: 2 n^3 flops).
inline void queue_matmuls(c10::Device device, int count, int64_t n = 4096) {
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor a = at::full({n, n}, 1.0f / static_cast<float>(n), options);
  at::Tensor b = at::full({n, n}, 1.0f, options);
  at::Tensor c = at::empty({n, n}, options);
  for (int i = 0; i < count; ++i) at::mm_out(c, a, b);
}

inline void synchronize_device(c10::Device device) {
  c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
}

// Seconds the device takes for queue_matmuls(device, count, n), measured (warm).
inline double matmuls_device_seconds(c10::Device device, int count, int64_t n = 4096) {
  queue_matmuls(device, 1, n);
  synchronize_device(device);
  const auto start = std::chrono::steady_clock::now();
  queue_matmuls(device, count, n);
  synchronize_device(device);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace dtrain::testing_util
