// CpuOptimizer: the tiled multi-threaded update and the copy-back pipeline.
#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <glog/logging.h>

#include <algorithm>

#include "cpu_optimizer_impl.h"
#include "dtrain/dist/error.h"

namespace dtrain::offload {
namespace {

// Members' parts of a tile start on 64-byte boundaries of the fp32 arrays.
constexpr int64_t kPartAlign = 16;
// Tiles smaller than this run on the calling thread alone (waking the team costs more).
constexpr int64_t kMinParallelElems = int64_t{1} << 15;

// The first segment (sorted, disjoint) whose end is past i.
template <class Seg>
size_t first_ending_after(const std::vector<Seg>& segs, int64_t i) {
  auto it = std::upper_bound(segs.begin(), segs.end(), i,
                             [](int64_t x, const Seg& s) { return x < s.end; });
  return static_cast<size_t>(it - segs.begin());
}

}  // namespace

void CpuOptimizer::Impl::update(int64_t lo, int64_t hi, const std::vector<GradSeg>& grads) {
  static const std::vector<OutSeg> kNoOutput;
  const bool write = options.write_back;
  if (write) copy_back.begin_range();
  const int members = team->size();
  for (int64_t t0 = lo; t0 < hi; t0 += options.tile_elems) {
    const int64_t t1 = std::min(hi, t0 + options.tile_elems);
    const std::vector<OutSeg>& outs = write ? copy_back.prepare_tile(t0, t1) : kNoOutput;
    if (members == 1 || t1 - t0 < kMinParallelElems) {
      update_part(t0, t1, grads, outs);
    } else {
      team->run([&](int member) {
        auto [a, b] = ThreadPool::part(t0, t1, member, members, kPartAlign);
        update_part(a, b, grads, outs);
      });
    }
    if (write) copy_back.finish_tile();
  }
}

// Splits [a, b) into pieces inside one gradient segment, one state chunk and one output
// segment (or gap), and runs the kernel on each.
void CpuOptimizer::Impl::update_part(int64_t a, int64_t b, const std::vector<GradSeg>& grads,
                                     const std::vector<OutSeg>& outs) const {
  if (a >= b) return;
  size_t gi = first_ending_after(grads, a);
  size_t oi = first_ending_after(outs, a);
  const size_t arrays_used = array_ptrs.size();
  int64_t i = a;
  while (i < b) {
    while (grads[gi].end <= i) ++gi;
    const GradSeg& g = grads[gi];
    int64_t e = std::min(b, g.end);
    const int64_t rel = i - shard.begin;
    const int64_t chunk = rel >> chunk_shift;
    const int64_t in_chunk = rel - (chunk << chunk_shift);
    e = std::min(e, shard.begin + ((chunk + 1) << chunk_shift));
    UpdateArrays arr;
    while (oi < outs.size() && outs[oi].end <= i) ++oi;
    if (oi < outs.size()) {
      const OutSeg& o = outs[oi];
      if (o.begin <= i) {
        e = std::min(e, o.end);
        arr.out = o.ptr + (i - o.begin) * elem_size(o.type);
        arr.out_type = o.type;
      } else {
        e = std::min(e, o.begin);
      }
    }
    arr.param = array_ptrs[0][chunk] + in_chunk;
    arr.grad = g.ptr + (i - g.begin) * elem_size(g.type);
    arr.grad_type = g.type;
    arr.state0 = arrays_used > 1 ? array_ptrs[1][chunk] + in_chunk : nullptr;
    arr.state1 = arrays_used > 2 ? array_ptrs[2][chunk] + in_chunk : nullptr;
    arr.state2 = arrays_used > 3 ? array_ptrs[3][chunk] + in_chunk : nullptr;
    arr.n = e - i;
    kernel(config, arr);
    i = e;
  }
}

// ---- CopyBack -------------------------------------------------------------------------------

CopyBack::CopyBack(PinnedPool& pool, int64_t tile_elems) : pool_(pool), tile_elems_(tile_elems) {}

CopyBack::~CopyBack() {
  try {
    wait_all();
  } catch (const std::exception& e) {
    LOG(ERROR) << "CPU optimizer: waiting for copy-back at destruction failed: " << e.what();
  }
}

void CopyBack::set_targets(const std::vector<at::Tensor>& flats,
                           const std::vector<int64_t>& offsets, int64_t lo, int64_t hi) {
  std::optional<c10::Device> device;
  std::vector<Target> targets;
  for (size_t i = 0; i < flats.size(); ++i) {
    Target t;
    t.begin = std::max(offsets[i], lo);
    t.end = std::min(offsets[i] + flats[i].numel(), hi);
    if (t.begin >= t.end) continue;
    t.flat = flats[i].narrow(0, t.begin - offsets[i], t.end - t.begin);
    const ElemType native = elem_type_of(t.flat.scalar_type());
    t.type = native == ElemType::kNone ? ElemType::kFloat32 : native;
    if (t.flat.is_cpu()) {
      t.mode = native == ElemType::kNone ? Mode::kStagedHost : Mode::kDirect;
    } else {
      DTRAIN_CHECK(!device || *device == t.flat.device(), "CPU optimizer: copy-back targets on ",
                   device->str(), " and ", t.flat.device().str(),
                   "; one optimizer copies back to one device");
      device = t.flat.device();
      t.mode = Mode::kStagedDevice;
    }
    targets.push_back(std::move(t));
  }
  wait_all();
  targets_ = std::move(targets);
  // Staging for targets the kernel cannot write directly: allocated now, so a step never
  // fails half-way for memory.
  const bool staged = std::any_of(targets_.begin(), targets_.end(),
                                  [](const Target& t) { return t.mode != Mode::kDirect; });
  for (at::Tensor& slot : slots_) {
    if (staged && !slot.defined()) slot = pool_.allocate(tile_elems_ * 4);
  }
  if (device != device_) {
    device_ = device;
    copy_stream_.reset();
    compute_ready_.reset();
    copies_done_.reset();
    slot_events_.clear();
    if (device_) {
      c10::impl::VirtualGuardImpl impl(device_->type());
      copy_stream_ = impl.getStreamFromGlobalPool(*device_, /*isHighPriority=*/false);
      compute_ready_.emplace(device_->type());
      copies_done_.emplace(device_->type());
      for (int k = 0; k < kSlots; ++k) slot_events_.emplace_back(device_->type());
    }
  }
}

void CopyBack::begin_range() {
  if (!device_) return;
  c10::impl::VirtualGuardImpl impl(device_->type());
  compute_ready_->record(impl.getStream(*device_));
  compute_ready_->block(*copy_stream_);
}

char* CopyBack::acquire_slot() {
  if (!slot_acquired_) {
    if (!slot_events_.empty()) slot_events_[slot_].synchronize();  // its last copies are done
    slot_acquired_ = true;
  }
  return static_cast<char*>(slots_[slot_].data_ptr());
}

const std::vector<OutSeg>& CopyBack::prepare_tile(int64_t lo, int64_t hi) {
  outs_.clear();
  staged_.clear();
  slot_acquired_ = false;
  int64_t byte_offset = 0;
  auto it = std::upper_bound(targets_.begin(), targets_.end(), lo,
                             [](int64_t x, const Target& t) { return x < t.end; });
  for (; it != targets_.end() && it->begin < hi; ++it) {
    const int64_t s = std::max(it->begin, lo);
    const int64_t e = std::min(it->end, hi);
    const int size = elem_size(it->type);
    if (it->mode == Mode::kDirect) {
      outs_.push_back(
          {s, e, static_cast<char*>(it->flat.data_ptr()) + (s - it->begin) * size, it->type});
    } else {
      char* slot = acquire_slot();
      outs_.push_back({s, e, slot + byte_offset, it->type});
      staged_.push_back({static_cast<size_t>(it - targets_.begin()), s, e, byte_offset});
      byte_offset += (e - s) * size;
    }
  }
  return outs_;
}

void CopyBack::finish_tile() {
  if (staged_.empty()) return;
  bool to_device = false;
  for (const Staged& st : staged_) {
    const Target& t = targets_[st.target];
    const at::ScalarType dtype = t.type == ElemType::kFloat32    ? at::kFloat
                                 : t.type == ElemType::kBFloat16 ? at::kBFloat16
                                                                 : at::kHalf;
    at::Tensor src = slots_[slot_]
                         .narrow(0, st.byte_offset, (st.end - st.begin) * elem_size(t.type))
                         .view(dtype);
    at::Tensor dst = t.flat.narrow(0, st.begin - t.begin, st.end - st.begin);
    if (t.mode == Mode::kStagedHost) {
      dst.copy_(src);
    } else {
      c10::StreamGuard guard(*copy_stream_);
      dst.copy_(src, /*non_blocking=*/true);
      to_device = true;
    }
  }
  if (to_device) {
    slot_events_[slot_].record(*copy_stream_);
    device_copies_ = true;
  }
  slot_ = (slot_ + 1) % kSlots;
}

void CopyBack::end_step() {
  if (!device_ || !device_copies_) return;
  c10::impl::VirtualGuardImpl impl(device_->type());
  copies_done_->record(*copy_stream_);
  copies_done_->block(impl.getStream(*device_));
  device_copies_ = false;
}

void CopyBack::wait_all() {
  for (const c10::Event& e : slot_events_) e.synchronize();
  if (copies_done_) copies_done_->synchronize();
}

int64_t CopyBack::staging_bytes() const {
  int64_t total = 0;
  for (const at::Tensor& s : slots_) {
    if (s.defined()) total += pool_.charged_bytes(s.nbytes());
  }
  return total;
}

}  // namespace dtrain::offload
