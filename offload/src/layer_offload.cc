#include "dtrain/offload/layer_offload.h"

#include <optional>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/autocast_mode.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"
#include "dtrain/offload/page_locked.h"

namespace dtrain::offload {

struct LayerStreamer::Impl {
  struct Layer {
    std::vector<at::Tensor> params;  // the modules' parameters (their data switches)
    // The parameters' home is their data whenever the layer is not acquired: host memory, which
    // an optimizer may replace between steps (the delayed update swaps two buffers). The
    // copies' sources are taken there at prefetch() (host_of_copy), and restored by release().
    std::vector<at::Tensor> host;          // while acquired: the home to restore
    std::vector<const void*> host_of_copy;  // the sources of `device`
    std::vector<at::Tensor> device;  // device copies while fetched / acquired
    std::optional<c10::Event> ready;
    bool acquired = false;
    bool autocast_cache_before = true;  // the thread's autocast cache flag at acquire()
  };
  c10::Device device{c10::kCPU};
  std::vector<Layer> layers;
  std::optional<c10::Stream> copy_stream;
  int64_t host_bytes = 0;

  bool streaming() const { return !device.is_cpu(); }

  c10::Stream current_stream() const {
    c10::impl::VirtualGuardImpl impl(device.type());
    return impl.getStream(device);
  }
};

LayerStreamer::LayerStreamer(std::vector<std::shared_ptr<torch::nn::Module>> layers, c10::Device device)
    : impl_(std::make_unique<Impl>()) {
  DTRAIN_CHECK(!layers.empty(), "layer offload needs at least one layer");
  impl_->device = device;
  at::NoGradGuard no_grad;
  const bool pin = device.is_cuda();
  // Each parameter streamed by one layer: one shared by two would be moved to the device by
  // the second while the first still uses it, and its gradient (a host copy autograd adopts)
  // added on the host while the copy may still be in flight.
  std::unordered_map<const c10::TensorImpl*, size_t> owner;
  for (size_t i = 0; i < layers.size(); ++i) {
    DTRAIN_CHECK(layers[i] != nullptr, "layer offload: layer ", i, " is null");
    for (const at::Tensor& p : layers[i]->parameters()) {
      const auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), i);
      DTRAIN_CHECK(fresh, "layer offload: a parameter of shape ", p.sizes(), " belongs to layers ", it->second,
                   " and ", i, "; each streamed parameter must belong to one layer (untie it, or keep the "
                   "shared module resident on the device, outside the streamed layers)");
    }
  }
  for (auto& module : layers) {
    Impl::Layer layer;
    for (at::Tensor& p : module->parameters()) {
      // Page-locked at its exact size when large (page_locked.h: PyTorch's pinned blocks are
      // powers of two, up to twice the weights).
      at::Tensor host = host_empty(p.sizes(), p.scalar_type(), pin);
      host.copy_(p.detach());
      p.set_data(host);
      layer.params.push_back(p);
      impl_->host_bytes += static_cast<int64_t>(host.nbytes());
    }
    impl_->layers.push_back(std::move(layer));
  }
  if (impl_->streaming()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    impl_->copy_stream = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  }
}

LayerStreamer::~LayerStreamer() = default;

size_t LayerStreamer::size() const { return impl_->layers.size(); }
int64_t LayerStreamer::host_bytes() const { return impl_->host_bytes; }

void LayerStreamer::prefetch(size_t i) {
  if (i >= impl_->layers.size() || !impl_->streaming()) return;
  Impl::Layer& layer = impl_->layers[i];
  if (!layer.device.empty()) return;
  DTRAIN_CHECK(!layer.acquired, "layer offload: layer ", i, " is prefetched while acquired");
  c10::DeviceGuard device_guard(impl_->device);
  // The copy may overwrite memory just freed by kernels on the compute stream: order it after.
  c10::Event compute_done(impl_->device.type());
  compute_done.record(impl_->current_stream());
  compute_done.block(*impl_->copy_stream);
  // Everything is built aside and committed at the end: a copy that throws (out of memory at
  // the two-blocks-resident peak) leaves the layer without a half-made prefetch.
  std::vector<at::Tensor> device;
  std::vector<const void*> sources;
  {
    c10::StreamGuard stream_guard(*impl_->copy_stream);
    for (const at::Tensor& p : layer.params) {
      const at::Tensor h = p.detach();  // the home (not acquired)
      DTRAIN_CHECK(h.is_cpu(), "layer offload: a parameter of layer ", i, " is on ", h.device(),
                   " between its uses; its home is host memory");
      at::Tensor d = at::empty(h.sizes(), h.options().device(impl_->device).pinned_memory(false));
      d.copy_(h, /*non_blocking=*/true);
      device.push_back(std::move(d));
      sources.push_back(h.data_ptr());
    }
  }
  c10::Event ready(impl_->device.type());
  ready.record(*impl_->copy_stream);
  layer.device = std::move(device);
  layer.host_of_copy = std::move(sources);
  layer.ready.emplace(std::move(ready));
}

void LayerStreamer::acquire(size_t i, size_t next) {
  DTRAIN_CHECK(i < impl_->layers.size(), "layer offload: no layer ", i);
  Impl::Layer& layer = impl_->layers[i];
  if (!impl_->streaming()) return;  // CPU training: the parameters already live on the host
  DTRAIN_CHECK(!layer.acquired, "layer offload: layer ", i, " is acquired twice");
  // A copy made before the home moved (an optimizer published new weights since) is stale.
  for (size_t k = 0; k < layer.params.size() && !layer.device.empty(); ++k) {
    if (layer.params[k].data_ptr() != layer.host_of_copy[k]) {
      layer.device.clear();
      layer.ready.reset();
    }
  }
  prefetch(i);
  layer.ready->block(impl_->current_stream());
  // The copies were allocated on the copy stream and are used on the compute stream.
  auto* allocator = c10::getDeviceAllocator(impl_->device.type());
  layer.host.clear();
  for (size_t k = 0; k < layer.params.size(); ++k) {
    allocator->recordStream(layer.device[k].storage().data_ptr(), impl_->current_stream());
    layer.host.push_back(layer.params[k].detach());
    layer.params[k].set_data(layer.device[k]);
  }
  layer.acquired = true;
  // Autocast caches the low-precision copy of each weight (keyed by the parameter, whose data
  // we switch) until the outermost autocast region ends, i.e. every streamed block's bf16/fp16
  // weights until forward ends, undoing "two blocks resident". No caching while a block is
  // acquired: its weights are cast where they are used (each once per forward).
  layer.autocast_cache_before = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  // A prefetch that throws (out of memory) leaves layer i as it was before acquire(), so the
  // caller's back-off can retry: its parameters on their home, the autocast cache restored.
  if (next < impl_->layers.size() && next != i) {
    try {
      prefetch(next);
    } catch (...) {
      release(i);
      throw;
    }
  }
}

void LayerStreamer::release(size_t i) {
  DTRAIN_CHECK(i < impl_->layers.size(), "layer offload: no layer ", i);
  Impl::Layer& layer = impl_->layers[i];
  if (!impl_->streaming()) return;
  if (!layer.acquired) {  // a prefetch (or a failed acquire) only: drop its copies
    for (size_t k = 0; k < layer.host.size(); ++k) layer.params[k].set_data(layer.host[k]);  // a half-done acquire's
    layer.host.clear();
    layer.device.clear();
    layer.ready.reset();
    return;
  }
  at::autocast::set_autocast_cache_enabled(layer.autocast_cache_before);
  for (size_t k = 0; k < layer.params.size(); ++k) layer.params[k].set_data(layer.host[k]);
  layer.host.clear();
  layer.device.clear();  // freed once the compute stream's work on them is done (recordStream)
  layer.ready.reset();
  layer.acquired = false;
}

}  // namespace dtrain::offload
