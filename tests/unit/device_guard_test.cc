// Work that must run on a given device whatever the calling thread's current device is: the
// background checkpoint writer's thread (async_on_device) and ZeRO-3's unit buffers
// (materialize_unit_storage). A one-GPU machine cannot show a wrong device (there is no other),
// so these run on the CPU with a fake device type: c10's FakeGuardImpl registered for
// PrivateUse1 keeps a current device index per thread, 0 on a new thread, as CUDA starts every
// thread on GPU 0. They prove that the device is made current where the work runs; that the
// trainer hands its own device to the writer is read in trainer_checkpoint.cc, not tested here.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <future>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/impl/FakeGuardImpl.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/zero3/zero3_optimizer.h"
#include "dtrain/engine/state/host_staging.h"

namespace dtrain::engine {
namespace {

constexpr c10::DeviceType kFake = c10::DeviceType::PrivateUse1;

// Registers FakeGuardImpl for PrivateUse1 once, unless a real backend registered that type.
bool fake_device_registered() {
  static const bool ok = [] {
    if (c10::impl::hasDeviceGuardImpl(kFake)) return false;
    static const c10::impl::FakeGuardImpl<kFake> impl;
    c10::impl::DeviceGuardImplRegistrar registrar(kFake, &impl);
    return true;
  }();
  return ok;
}

int current_fake_index() { return c10::impl::getDeviceGuardImpl(kFake)->getDevice().index(); }

// Regression (the background save's writer thread made a CUDA context on GPU 0 on every rank):
// the writer's thread runs with the device it was given.
TEST(DeviceThreads, AsyncOnDeviceRunsOnTheDeviceItWasGiven) {
  if (!fake_device_registered()) GTEST_SKIP() << "PrivateUse1 has a device guard of a real backend here";
  EXPECT_EQ(std::async(std::launch::async, current_fake_index).get(), 0) << "a plain new thread starts on device 0";
  EXPECT_EQ(async_on_device(c10::Device(kFake, 3), current_fake_index).get(), 3);
  EXPECT_EQ(current_fake_index(), 0) << "the calling thread's device is left as it was";
  // A CPU device sets nothing; results and failures come through the future.
  EXPECT_EQ(async_on_device(c10::Device(c10::kCPU), [] { return std::string("written"); }).get(), "written");
  auto failing = async_on_device(c10::Device(kFake, 1), []() -> std::string { throw Error("disk full"); });
  EXPECT_THROW(failing.get(), Error);
}

// Allocates on the fake device that is current, as the CUDA caching allocator allocates on the
// current device, and records which that was.
struct CurrentDeviceAllocator final : c10::Allocator {
  std::vector<int> devices;
  c10::DataPtr allocate(size_t n) override {
    const c10::Device current = c10::impl::getDeviceGuardImpl(kFake)->getDevice();
    devices.push_back(current.index());
    void* p = std::malloc(std::max<size_t>(n, 1));
    return {p, p, &std::free, current};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &std::free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

// Regression (ZeRO-3's unit buffers were allocated on the calling thread's current device, GPU
// 0 for a thread that set none): a unit's bytes come from its own device.
TEST(DeviceThreads, UnitStorageIsMaterializedOnTheTensorsDevice) {
  if (!fake_device_registered()) GTEST_SKIP() << "PrivateUse1 has a device guard of a real backend here";
  CurrentDeviceAllocator allocator;
  const c10::Device unit_device(kFake, 2);
  void* bytes = std::malloc(64);
  c10::Storage storage(c10::Storage::use_byte_size_t(), 64, c10::DataPtr(bytes, bytes, &std::free, unit_device),
                       &allocator, /*resizable=*/false);
  at::Tensor unit = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), caffe2::TypeMeta::Make<float>());
  unit.unsafeGetTensorImpl()->set_sizes_contiguous({16});
  ASSERT_EQ(unit.device(), unit_device);
  ASSERT_EQ(current_fake_index(), 0);
  for (int gather = 0; gather < 2; ++gather) {
    release_unit_storage(unit);
    EXPECT_EQ(unit.storage().nbytes(), 0u);
    materialize_unit_storage(unit);
    ASSERT_EQ(allocator.devices.size(), static_cast<size_t>(gather + 1));
    EXPECT_EQ(allocator.devices.back(), 2) << "the unit's bytes were allocated on the current device, not its own";
    EXPECT_EQ(unit.storage().data_ptr().device(), unit_device);
    EXPECT_EQ(unit.storage().nbytes(), 64u);
    EXPECT_EQ(current_fake_index(), 0) << "the calling thread's device is left as it was";
  }
  // From another thread too (autograd's, a checkpoint writer's: device 0 when they set none).
  std::async(std::launch::async, [&] { materialize_unit_storage(unit); }).get();
  EXPECT_EQ(allocator.devices.back(), 2);
}

}  // namespace
}  // namespace dtrain::engine
