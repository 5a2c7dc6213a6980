#include <cstdio>
#include <ATen/ATen.h>
#include "dtrain/dist/communicator.h"
#include "dtrain/engine/core/version.h"
int main() {
  auto world = dtrain::dist::detect_world();
  auto comm = dtrain::dist::create_communicator("local", world, c10::Device(c10::kCPU));
  at::Tensor x = at::ones({4});
  comm->all_reduce(x)->wait();
  std::printf("dtrain %s: sum %.0f\n", dtrain::version(), x.sum().item<float>());
}
