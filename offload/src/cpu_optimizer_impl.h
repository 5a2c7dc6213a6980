// Private parts of CpuOptimizer shared by its source files.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/offload/cpu_optimizer.h"
#include "dtrain/offload/thread_pool.h"

namespace dtrain::offload {

// The element type the kernels read or write for dtype; kNone when they cannot.
ElemType elem_type_of(at::ScalarType dtype);
int elem_size(ElemType type);

// A run of gradient elements [begin, end) of the flat space; ptr points at element begin.
struct GradSeg {
  int64_t begin = 0;
  int64_t end = 0;
  const char* ptr = nullptr;
  ElemType type = ElemType::kFloat32;
};

// A run of copy-back destination [begin, end); ptr points at element begin.
struct OutSeg {
  int64_t begin = 0;
  int64_t end = 0;
  char* ptr = nullptr;
  ElemType type = ElemType::kNone;
};

// Where updated weights go: direct kernel writes for host targets of a kernel dtype; pinned
// staging tiles then copies (asynchronous on a copy stream for a device) for the rest.
// Not thread-safe (driven by the optimizer's calling thread).
class CopyBack {
 public:
  CopyBack(PinnedPool& pool, int64_t tile_elems);
  ~CopyBack();  // waits for copies in flight (logs failures)

  // flats[i]: contiguous 1-D tensor holding flat elements [offsets[i], offsets[i] +
  // flats[i].numel()); sorted, disjoint. Only the part inside [lo, hi) is ever written.
  // Throws for targets on more than one non-CPU device. Waits for copies in flight.
  void set_targets(const std::vector<at::Tensor>& flats, const std::vector<int64_t>& offsets,
                   int64_t lo, int64_t hi);
  // Orders later device copies after the work queued so far on the calling thread's current
  // stream (once per step_range).
  void begin_range();
  // Out segments for flat [lo, hi) (sorted; gaps where no target is), pointing into the
  // targets or into a free staging slot (waits for the slot's previous copies).
  const std::vector<OutSeg>& prepare_tile(int64_t lo, int64_t hi);
  // Issues the copies of the tile prepared last, from its staging slot.
  void finish_tile();
  // The calling thread's current stream waits for every device copy issued so far.
  void end_step();
  // The host waits for every copy in flight.
  void wait_all();
  int64_t staging_bytes() const;

 private:
  enum class Mode { kDirect, kStagedHost, kStagedDevice };
  struct Target {
    int64_t begin = 0;
    int64_t end = 0;
    at::Tensor flat;
    Mode mode = Mode::kDirect;
    ElemType type = ElemType::kNone;  // what the kernel writes (direct or into staging)
  };
  struct Staged {
    size_t target = 0;
    int64_t begin = 0;
    int64_t end = 0;
    int64_t byte_offset = 0;
  };
  char* acquire_slot();

  PinnedPool& pool_;
  const int64_t tile_elems_;
  std::vector<Target> targets_;
  std::optional<c10::Device> device_;  // the device of the device targets, if any
  std::optional<c10::Stream> copy_stream_;
  std::optional<c10::Event> compute_ready_;
  std::optional<c10::Event> copies_done_;
  static constexpr int kSlots = 2;
  at::Tensor slots_[kSlots];
  std::vector<c10::Event> slot_events_;  // per slot, when device targets exist
  int slot_ = 0;                         // slot of the tile being prepared
  bool slot_acquired_ = false;
  std::vector<OutSeg> outs_;
  std::vector<Staged> staged_;
  bool device_copies_ = false;  // device copies issued since the last end_step
};

struct CpuOptimizer::Impl {
  Impl(std::vector<at::Tensor> params, CpuOptimizerOptions options, PinnedPool& pool);

  void allocate_arrays();
  void set_default_targets();
  // The kernel over [lo, hi) (inside the shard's real range) with these gradients.
  void update(int64_t lo, int64_t hi, const std::vector<GradSeg>& grads);
  void update_part(int64_t a, int64_t b, const std::vector<GradSeg>& grads,
                   const std::vector<OutSeg>& outs) const;
  // Records [lo, hi) as updated in this step; throws if it overlaps an earlier range.
  void check_not_covered(int64_t lo, int64_t hi) const;
  void mark_covered(int64_t lo, int64_t hi);
  std::vector<GradSeg> grad_segments_from_params(std::vector<at::Tensor>& keep_alive) const;
  int64_t chunk_count() const;
  int64_t chunk_size(int64_t chunk) const;

  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;  // params.size() + 1 entries
  CpuOptimizerOptions options;
  PinnedPool& pool;
  int64_t numel = 0;
  int64_t padded = 0;
  ShardRange shard;
  int64_t real_end = 0;  // min(shard.end, numel): the last real element + 1 of the shard
  Isa isa = Isa::kScalar;
  UpdateFn kernel = nullptr;
  std::unique_ptr<ThreadPool> team;
  int chunk_shift = 0;  // log2(chunk_elems)

  // arrays[k][c]: chunk c of array k; array 0 is the master weights, then the rule's state.
  std::vector<std::string> array_names;
  std::vector<std::vector<at::Tensor>> arrays;
  std::vector<std::vector<float*>> array_ptrs;
  int64_t host_bytes = 0;

  double lr = 0.0;
  int64_t step = 0;
  bool open = false;
  UpdateConfig config;
  std::map<int64_t, int64_t> covered;  // begin -> end of ranges updated in the open step

  at::Tensor output;  // set_output's tensor, or undefined: the parameters
  int64_t output_start = 0;  // the flat element output[0] holds
  CopyBack copy_back;
};

}  // namespace dtrain::offload
