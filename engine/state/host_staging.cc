#include "dtrain/engine/state/host_staging.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <glog/logging.h>

namespace dtrain::engine {

namespace {

c10::Stream current_stream(const c10::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device);
}

}  // namespace

HostStaging::~HostStaging() {
  try {
    fence();  // the device's work after this point may free or reuse what the copies read
  } catch (const std::exception& e) {
    LOG(ERROR) << "checkpoint staging teardown: " << e.what();
  }
}

HostStaging::DeviceCopies& HostStaging::copies_on(const c10::Device& device) {
  auto it = devices_.find(device);
  if (it != devices_.end()) return it->second;
  DeviceCopies& d = devices_[device];
  c10::impl::VirtualGuardImpl impl(device.type());
  d.side = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  d.issued.emplace(device.type());
  d.side_done.emplace(device.type());
  d.now_done.emplace(device.type());
  return d;
}

at::Tensor HostStaging::stage(const std::string& key, const at::Tensor& source, Source when) {
  if (sealed_) {  // the first copy of a new save
    fence();
    for (auto& [device, d] : devices_) d.any_side = d.any_now = false;
    sealed_ = false;
  }
  const at::Tensor t = source.detach();
  if (t.device().is_cpu()) return t.clone();
  at::Tensor& buffer = buffers_[key];
  if (!buffer.defined() || buffer.sizes() != t.sizes() || buffer.scalar_type() != t.scalar_type()) {
    buffer = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true));
  }
  DeviceCopies& d = copies_on(t.device());
  if (when == kUntilNextUpdate) {
    // The side stream goes on only after the work issued so far on the current stream: t's
    // last write may have come after the previous stage() call (an optimizer's state() makes
    // SGD's step counters just before they are staged). An event record and a stream wait per
    // tensor, on the host a few microseconds.
    d.issued->record(current_stream(t.device()));
    d.issued->block(*d.side);
    d.any_side = true;
    c10::StreamGuard guard(*d.side);
    buffer.copy_(t, /*non_blocking=*/true);
  } else {
    buffer.copy_(t, /*non_blocking=*/true);
    d.any_now = true;
  }
  sources_.push_back(t);
  return buffer;
}

void HostStaging::seal() {
  for (auto& [device, d] : devices_) {
    if (d.any_side) d.side_done->record(*d.side);
    if (d.any_now) d.now_done->record(current_stream(device));
  }
  sealed_ = true;
  fenced_ = false;
}

void HostStaging::wait() const {
  for (const auto& [device, d] : devices_) {
    c10::DeviceGuard guard(device);  // the calling thread (a writer's) may have no current device
    if (d.any_side) d.side_done->synchronize();
    if (d.any_now) d.now_done->synchronize();
  }
}

void HostStaging::fence() {
  if (!sealed_ || fenced_) return;
  for (auto& [device, d] : devices_) {
    if (d.any_side) d.side_done->block(current_stream(device));
  }
  sources_.clear();  // later frees are ordered after the copies on every stream that read them
  fenced_ = true;
}

int64_t HostStaging::pinned_bytes() const {
  int64_t bytes = 0;
  for (const auto& [key, buffer] : buffers_) bytes += buffer.nbytes();
  return bytes;
}

}  // namespace dtrain::engine
