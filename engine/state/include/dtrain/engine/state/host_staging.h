// Host copies of training state for a checkpoint written in the background.
#pragma once

#include <future>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace dtrain::engine {

// The step that saves copies its state here and goes on; a writer thread waits for the copies
// and serializes them (torch.distributed.checkpoint.async_save's staging, in C++).
//
//   staging.stage(name, t, HostStaging::kUntilNextUpdate)  // per tensor, on the training thread
//   staging.seal();                                        // after the last stage()
//   ... writer thread: staging.wait(); then read the staged tensors
//   ... training thread, before it next writes the sources: staging.fence();
//
// A device tensor is copied with non_blocking copies into a pinned host buffer that is kept
// under its key and reused by later saves of the same shape and dtype (the first save pays
// for the pinned allocation, later ones only for the copy). kUntilNextUpdate sources (weights,
// optimizer state: written only by the next optimizer update) are copied on a side stream of
// their device, so the copy overlaps the next step's forward and backward; each such copy
// starts after the work issued on the device's current stream before its stage() call (a
// source created or written just before, such as the step counters an optimizer's state()
// makes, is copied after that write, wherever it falls among the save's stage() calls).
// fence() makes the device's current stream wait for those copies before the update writes
// the sources.
// kNow sources (buffers that the next forward writes, such as BatchNorm's running statistics)
// are copied on the current stream, ordered before anything issued after them. A host tensor
// is cloned at once (no buffer is kept: host state can be as large as the host's memory).
//
// One save at a time: stage() and seal() must not run while a writer is still reading the
// previous save's buffers (wait for it first). The sources staged are kept alive until fence().
// Not thread-safe except that wait() may run on another thread than stage/seal/fence (any
// thread: it makes each device current while it waits for it, so a writer thread makes no
// CUDA context on GPU 0).
class HostStaging {
 public:
  enum Source { kNow, kUntilNextUpdate };

  HostStaging() = default;
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // The host tensor that will hold t's value as of this call once wait() returns. `key` names
  // the buffer (unique within a save).
  at::Tensor stage(const std::string& key, const at::Tensor& t, Source source);
  // Marks the end of this save's copies (records their completion on every device).
  void seal();
  // Blocks the calling thread until every sealed copy has landed in host memory.
  void wait() const;
  // Makes each device's current stream wait for the sealed side-stream copies and releases the
  // sources. Idempotent; a no-op when nothing is pending.
  void fence();
  // Bytes of pinned host memory kept for reuse.
  int64_t pinned_bytes() const;

 private:
  struct DeviceCopies {
    std::optional<c10::Stream> side;
    std::optional<c10::Event> issued;  // current stream, before each side copy
    std::optional<c10::Event> side_done;
    std::optional<c10::Event> now_done;
    bool any_side = false;
    bool any_now = false;
  };
  DeviceCopies& copies_on(const c10::Device& device);

  std::map<std::string, at::Tensor> buffers_;   // pinned, by key
  std::unordered_map<c10::Device, DeviceCopies> devices_;  // by the source's device
  std::vector<at::Tensor> sources_;             // kept alive until fence()
  bool sealed_ = false;  // seal() ran; the next stage() starts a new save
  bool fenced_ = true;   // fence() ran since the last seal()
};

// Runs fn on a thread of its own whose current device is `device` for the whole run
// (c10::DeviceGuard; a CPU device sets nothing), and returns fn's result as a std::future, as
// std::async(std::launch::async, fn) does. A new thread's current CUDA device is GPU 0: a
// background writer without this makes a CUDA context there with its first CUDA call (an
// event wait, a device read), on every rank of a node.
template <class Fn>
auto async_on_device(c10::Device device, Fn fn) -> std::future<decltype(fn())> {
  return std::async(std::launch::async, [device, fn = std::move(fn)]() mutable {
    c10::OptionalDeviceGuard guard;
    if (!device.is_cpu()) guard.reset_device(device);
    return fn();
  });
}

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
