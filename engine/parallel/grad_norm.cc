#include "dtrain/engine/parallel/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <mutex>
#include <unordered_map>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/sparse_reducer.h"
#include "dtrain/offload/thread_pool.h"

namespace dtrain::engine {
namespace {

// Norms accumulate in float64 when any gradient (or parameter) is float64, else in float32.
at::ScalarType accumulation_type(const std::vector<at::Tensor>& grads) {
  for (const at::Tensor& g : grads) {
    if (g.defined() && g.scalar_type() == at::kDouble) return at::kDouble;
  }
  return at::kFloat;
}

// Squares summed in 16 float32 lanes over blocks of 1024 elements (64 per lane, near float32's
// rounding), the blocks' sums in float64; float64 input in float64 lanes. Compiled for AVX-512,
// AVX2 and the baseline, chosen at load time (the library's baseline is SSE2: a third slower).
template <typename T, typename Acc>
[[gnu::always_inline]] inline double sum_squares_blocks(const T* p, int64_t n) {
  constexpr int64_t kBlock = 1024;
  constexpr int kLanes = 16;
  double total = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    Acc lanes[kLanes] = {};
    int64_t i = b;
    for (; i + kLanes <= e; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const Acc v = static_cast<Acc>(p[i + l]);
        lanes[l] += v * v;
      }
    }
    double block = 0;
    for (; i < e; ++i) block += static_cast<double>(p[i]) * static_cast<double>(p[i]);
    for (Acc l : lanes) block += static_cast<double>(l);
    total += block;
  }
  return total;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DTRAIN_HOST_NORM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DTRAIN_HOST_NORM_CLONES
#endif

DTRAIN_HOST_NORM_CLONES double sum_squares_f32(const float* p, int64_t n) {
  return sum_squares_blocks<float, float>(p, n);
}
DTRAIN_HOST_NORM_CLONES double sum_squares_f64(const double* p, int64_t n) {
  return sum_squares_blocks<double, double>(p, n);
}
DTRAIN_HOST_NORM_CLONES double sum_squares_bf16(const c10::BFloat16* p, int64_t n) {
  return sum_squares_blocks<c10::BFloat16, float>(p, n);
}
DTRAIN_HOST_NORM_CLONES double sum_squares_f16(const c10::Half* p, int64_t n) {
  return sum_squares_blocks<c10::Half, float>(p, n);
}

double sum_squares(const at::Tensor& t, int64_t begin, int64_t n) {
  switch (t.scalar_type()) {
    case at::kFloat: return sum_squares_f32(t.const_data_ptr<float>() + begin, n);
    case at::kDouble: return sum_squares_f64(t.const_data_ptr<double>() + begin, n);
    case at::kBFloat16: return sum_squares_bf16(t.const_data_ptr<c10::BFloat16>() + begin, n);
    case at::kHalf: return sum_squares_f16(t.const_data_ptr<c10::Half>() + begin, n);
    default: DTRAIN_CHECK(false, "grad_norm: no host kernel for ", t.scalar_type());
  }
  return 0;
}

// Below this many elements a CPU group keeps ATen's _foreach_norm (the small models of tests,
// rounded as before); above, its one-thread-per-list loop is the cost: 37 ms for the 85M host
// gradients of gpt124m's streamed blocks on a 16-core host (docs/BENCHMARKS.md, layer offload).
constexpr int64_t kParallelHostNormElems = int64_t{1} << 22;

// Each tensor's 2-norm, in `acc`, for contiguous CPU tensors: the elements in pieces of
// 1 Mi, dealt round-robin to at::get_num_threads() threads, each piece's squares in float64.
std::vector<at::Tensor> host_norms(const std::vector<at::Tensor>& list, at::ScalarType acc) {
  constexpr int64_t kPiece = int64_t{1} << 20;
  struct Piece {
    size_t tensor;
    int64_t begin, n;
  };
  std::vector<Piece> pieces;
  for (size_t k = 0; k < list.size(); ++k) {
    for (int64_t b = 0; b < list[k].numel(); b += kPiece) pieces.push_back({k, b, std::min(kPiece, list[k].numel() - b)});
  }
  std::vector<double> partial(pieces.size(), 0.0);
  // dtrain's own team (at::parallel_for's OpenMP region is inline in ATen's headers, and this
  // library is not built with -fopenmp: it would run on one thread), sized once for the
  // machine; at::get_num_threads() of its members take part.
  const int threads = std::max(1, at::get_num_threads());
  const int64_t count = static_cast<int64_t>(pieces.size());
  offload::run_on_shared_team([&](int member, int team) {
    const int members = std::min(team, threads);
    if (member >= members) return;
    for (int64_t q = member; q < count; q += members) {
      partial[q] = sum_squares(list[pieces[q].tensor], pieces[q].begin, pieces[q].n);
    }
  });
  std::vector<double> squares(list.size(), 0.0);
  for (size_t q = 0; q < pieces.size(); ++q) squares[pieces[q].tensor] += partial[q];
  std::vector<at::Tensor> norms;
  for (double sq : squares) norms.push_back(at::scalar_tensor(std::sqrt(sq), at::TensorOptions().dtype(acc)));
  return norms;
}

bool host_kernel_applies(const std::vector<at::Tensor>& list) {
  int64_t total = 0;
  for (const at::Tensor& g : list) {
    if (!g.device().is_cpu() || !g.is_contiguous() || g.is_complex()) return false;
    total += g.numel();
  }
  return total >= kParallelHostNormElems;
}

// note_device_norm()'s entries, keyed by storage: the weak reference tells a storage freed
// (and its address reused) from the one noted.
struct NotedNorm {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t numel = 0;
  int64_t version = 0;
  at::Tensor norm;
};

struct NotedNorms {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, NotedNorm> by_storage;  // guarded by mu
};

NotedNorms& noted_norms() {
  static NotedNorms* n = new NotedNorms();  // never destroyed: gradients may outlive statics
  return *n;
}

// The noted norm of g, when g is the whole noted storage at the noted version.
std::optional<at::Tensor> noted_norm_of(const at::Tensor& g) {
  if (!g.is_cpu() || !g.has_storage() || g.storage_offset() != 0) return std::nullopt;
  NotedNorms& n = noted_norms();
  std::lock_guard<std::mutex> lock(n.mu);
  auto it = n.by_storage.find(g.storage().unsafeGetStorageImpl());
  if (it == n.by_storage.end()) return std::nullopt;
  const NotedNorm& e = it->second;
  if (e.storage.expired()) {
    n.by_storage.erase(it);
    return std::nullopt;
  }
  if (e.numel != g.numel() || e.version != g._version()) return std::nullopt;
  return e.norm;
}

}  // namespace

void note_device_norm(const at::Tensor& host_copy, at::Tensor norm) {
  DTRAIN_CHECK(host_copy.is_cpu() && host_copy.has_storage() && host_copy.storage_offset() == 0 &&
                   norm.numel() == 1 && (norm.scalar_type() == at::kFloat || norm.scalar_type() == at::kDouble),
               "note_device_norm: a host tensor of its own storage and a one-element float norm, got ",
               host_copy.toString(), " and ", norm.toString());
  NotedNorms& n = noted_norms();
  std::lock_guard<std::mutex> lock(n.mu);
  for (auto it = n.by_storage.begin(); it != n.by_storage.end();) {  // drop the freed ones
    it = it->second.storage.expired() ? n.by_storage.erase(it) : std::next(it);
  }
  c10::StorageImpl* storage = host_copy.storage().unsafeGetStorageImpl();
  n.by_storage.insert_or_assign(storage, NotedNorm{host_copy.storage().getWeakStorageImpl(), host_copy.numel(),
                                                  host_copy._version(), norm.reshape({})});
}

at::Tensor grad_norm(const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  // Per (device, dtype): the per-tensor norms in one multi-tensor launch.
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
  std::vector<at::Tensor> noted;  // norms taken on a device before the gradients' copies
  c10::optional<c10::Device> first_device;
  for (const at::Tensor& grad : grads) {
    const at::Tensor g = gradient_values(grad);  // a sparse gradient's rows
    if (!g.defined()) continue;
    DTRAIN_CHECK(g.layout() == at::kStrided && at::isFloatingType(g.scalar_type()),
                 "grad_norm: gradients must be dense floating-point tensors, got ", g.toString());
    if (!first_device) first_device = g.device();
    if (std::optional<at::Tensor> n = g.is_cpu() && !grad.is_sparse() ? noted_norm_of(g) : std::nullopt) {
      noted.push_back(*n);
      continue;
    }
    groups[{g.device().str(), g.scalar_type()}].push_back(g);
  }
  if (!first_device) return at::zeros(c10::IntArrayRef{}, at::kFloat);
  const at::ScalarType acc = accumulation_type(grads);
  std::vector<at::Tensor> norms;
  for (const at::Tensor& n : noted) norms.push_back(n.to(*first_device, acc, /*non_blocking=*/!first_device->is_cpu()));
  for (auto& [key, list] : groups) {
    for (at::Tensor& n : host_kernel_applies(list) ? host_norms(list, acc) : at::_foreach_norm(list, 2, acc)) {
      // Asynchronous unless the copy lands on the host (the CPU ops after it would race).
      norms.push_back(n.to(*first_device, acc, /*non_blocking=*/!first_device->is_cpu()));
    }
  }
  at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  return total.to(at::kFloat);
}

at::Tensor global_grad_norm(const std::vector<at::Tensor>& params, const GradNormLayout& layout) {
  const bool split = !layout.sharded.empty() && layout.tp && layout.tp->size() > 1;
  const bool staged = layout.pp && layout.pp->size() > 1;
  const bool owned = layout.partitioned;
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const at::Tensor& p : params) grads.push_back(p.grad());
  if (!split && !owned && !staged) return grad_norm(grads);
  const bool flat = owned && layout.owned_values.defined();
  DTRAIN_CHECK(layout.sharded.empty() || layout.sharded.size() == params.size(), "global_grad_norm: ",
               params.size(), " parameters but ", layout.sharded.size(), " sharded flags");
  DTRAIN_CHECK(!owned || layout.dp, "global_grad_norm: partitioned gradients need the data-parallel communicator");
  DTRAIN_CHECK(!flat || layout.owned_at.size() == layout.owned.size(), "global_grad_norm: ", layout.owned.size(),
               " owned ranges but ", layout.owned_at.size(), " positions of them in the owned values");
  // Accumulated as grad_norm() does, so a sharded or split run clips by the same coefficient.
  // Decided by the parameters (a gradient has its parameter's dtype), so every rank agrees
  // even where a rank holds no gradient (ZeRO-2 releases those outside its range).
  const at::ScalarType acc_type = accumulation_type(params);
  at::Tensor sq_shard, sq_rep;
  std::optional<c10::Device> device;
  int64_t offset = 0;
  size_t first_range = 0;  // the first owned range not wholly before this parameter
  auto add = [&](size_t i, const at::Tensor& part) {
    at::Tensor sq = part.to(acc_type).pow(2).sum();
    at::Tensor& acc = !layout.sharded.empty() && layout.sharded[i] ? sq_shard : sq_rep;
    acc = acc.defined() ? acc + sq : sq;
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel(), begin = offset, end = offset + n;
    offset = end;
    const at::Tensor g = gradient_values(params[i].grad());  // a sparse gradient's rows
    if (!device) device = params[i].device();
    if (!owned) {
      if (g.defined()) add(i, g);
      continue;
    }
    if (!g.defined() && !flat) continue;
    while (first_range < layout.owned.size() && layout.owned[first_range].end <= begin) ++first_range;
    for (size_t q = first_range; q < layout.owned.size() && layout.owned[q].begin < end; ++q) {
      const int64_t a = std::max(layout.owned[q].begin, begin), b = std::min(layout.owned[q].end, end);
      if (a >= b) continue;
      add(i, flat                 ? layout.owned_values.narrow(0, layout.owned_at[q] + a - layout.owned[q].begin, b - a)
             : a == begin && b == end ? g
                                      : g.reshape({-1}).narrow(0, a - begin, b - a));
    }
  }
  const at::Tensor& any = sq_shard.defined() ? sq_shard : sq_rep;
  DTRAIN_CHECK(any.defined() || owned, "global_grad_norm: no gradients");
  const auto options = any.defined() ? any.options() : at::TensorOptions().dtype(acc_type).device(*device);
  if (!sq_shard.defined()) sq_shard = at::zeros({}, options);
  if (!sq_rep.defined()) sq_rep = at::zeros({}, options);
  at::Tensor s = sq_shard.reshape({1}).clone();
  if (split) layout.tp->all_reduce(s)->wait();
  at::Tensor total = s + sq_rep.reshape({1});
  if (owned && layout.dp->size() > 1) layout.dp->all_reduce(total)->wait();
  if (staged) layout.pp->all_reduce(total)->wait();
  return total.sqrt().reshape({}).to(at::kFloat);
}

}  // namespace dtrain::engine
