// Layer offload: the parameters of chosen layers live in (pinned) host memory and are copied
// to the device just before the layer runs, one layer ahead on a copy stream, in forward and
// again in backward, and freed right after. Used together with activation checkpointing
// (engine::checkpoint with CheckpointHooks), which recomputes the layer in backward, so
// neither the layer's weights nor its activations stay on the device between uses.
// Gradients of the host parameters come back to the host (the optimizer updates them there).
// A parameter's home is its data whenever its layer is not acquired: an optimizer may point it
// at other host memory between uses (the one-rank delayed update of optimizer offload swaps
// two page-locked buffers), and the next prefetch copies from there; a copy prefetched before
// such a move is made again at acquire().
//
// Streams: copies run on a copy stream of the device; acquire() makes the calling thread's
// current stream wait for them, release() records the current stream on the device copies
// before dropping them, so the caching allocator reuses their memory only after the layer's
// kernels ran. Thread-safety: one thread drives forward and backward (autograd's device
// thread in backward; calls never overlap). The modules must outlive the streamer.
#pragma once

#include <memory>
#include <vector>

#include <c10/core/Device.h>
#include <torch/nn/module.h>

namespace dtrain::offload {

class PinnedPool;

class LayerStreamer {
 public:
  // Moves every parameter of each layer to host memory (pinned when the device is CUDA; the
  // parameters keep their autograd identity: set_data). `device` is where layers run.
  LayerStreamer(std::vector<std::shared_ptr<torch::nn::Module>> layers, c10::Device device);
  ~LayerStreamer();
  LayerStreamer(const LayerStreamer&) = delete;
  LayerStreamer& operator=(const LayerStreamer&) = delete;

  size_t size() const;
  // Starts copying layer i's parameters to the device (no-op when already started/present).
  void prefetch(size_t i);
  // Points layer i's parameters at their device copies (prefetching them if needed) and
  // starts prefetching layer `next` (pass size() for none).
  void acquire(size_t i, size_t next);
  // Points layer i's parameters back at host memory and frees the device copies.
  void release(size_t i);
  // Bytes of parameters kept on the host.
  int64_t host_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::offload

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
