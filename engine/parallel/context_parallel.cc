// Context parallelism: the load-balanced sequence layout and exact ring attention (see
// context_parallel.h).
#include "dtrain/engine/parallel/context_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "dtrain/dist/error.h"
#include "parallel_comm_internal.h"

namespace dtrain::engine {
namespace {

void cp_check_layout(int64_t seq_len, int cp_rank, int cp_size, const char* what) {
  DTRAIN_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size, what, ": rank ", cp_rank,
               " is not a rank of a context-parallel group of ", cp_size);
  DTRAIN_CHECK(cp_size == 1 || (seq_len > 0 && seq_len % (2 * cp_size) == 0), what,
               ": cannot split a sequence of S=", seq_len, " tokens over C=", cp_size,
               " context-parallel ranks: the load-balanced layout cuts it into 2C=", 2 * cp_size,
               " equal chunks, so S must be a multiple of 2C=", 2 * cp_size,
               "; choose a sequence length that is a multiple of 2 x --cp (or pad the sequence)");
}

// A contiguous run of a rank's tokens: `len` tokens at local index `local`, global `global`.
struct CpSegment {
  int64_t local, len, global;
};

// The runs of rank's s_local tokens: the whole as one run (a group of one, or no need for
// positions), else its two chunks.
std::vector<CpSegment> cp_segments(int64_t s_local, int rank, int size, bool by_chunk) {
  if (size == 1 || !by_chunk) return {{0, s_local, 0}};
  const int64_t c = s_local / 2;
  return {{0, c, rank * c}, {c, c, (2 * size - 1 - rank) * c}};
}

// The tiles a pass over a block works on: each run cut into pieces of at most kRingTile tokens.
// A (query tile, key tile) pair's scores are [B, H, tile, tile] at most, so the memory a block
// pair needs beyond the saved tensors is bounded whatever the sequence length (without tiles a
// chunk pair's scores would be (S/2C)^2 per head: quadratic in the sequence). The online-softmax
// merge puts the key tiles of a block together exactly as it puts the blocks together.
constexpr int64_t kRingTile = 512;

std::vector<CpSegment> ring_tiles(int64_t s_local, int rank, int size, bool by_chunk) {
  std::vector<CpSegment> tiles;
  for (const CpSegment& run : cp_segments(s_local, rank, size, by_chunk)) {
    for (int64_t at = 0; at < run.len; at += kRingTile) {
      tiles.push_back({run.local + at, std::min(kRingTile, run.len - at), run.global + at});
    }
  }
  return tiles;
}

// ---- tracing ---------------------------------------------------------------------------------
using RingClock = std::chrono::steady_clock;
std::atomic<bool> g_ring_tracing{false};
std::mutex g_ring_mutex;
std::vector<RingEvent> g_ring_events;

void ring_record(const char* name, int step, RingClock::time_point start) {
  if (!g_ring_tracing.load(std::memory_order_relaxed)) return;
  const RingClock::time_point end = RingClock::now();
  std::lock_guard<std::mutex> lock(g_ring_mutex);
  if (g_ring_events.size() < 100000) g_ring_events.push_back(RingEvent{name, step, start, end});
}

// ---- the ring ------------------------------------------------------------------------------
// One step's exchange: `out` goes to the next rank, `incoming` (like it) comes from the previous.
struct RingExchange {
  at::Tensor incoming;
  dist::WorkPtr sent, received;
  RingClock::time_point launched;
  int step = 0;
  at::Tensor wait() {
    sent->wait();
    received->wait();
    ring_record("ring exchange", step, launched);
    return incoming;
  }
};

RingExchange ring_exchange(dist::Communicator& cp, const at::Tensor& out, int step) {
  const int n = cp.size(), r = cp.rank();
  RingExchange x;
  x.launched = RingClock::now();
  x.step = step;
  x.incoming = at::empty_like(out);
  dist::CommGroup group(cp);  // one launch on NCCL: the ring's sends pair with its receives
  x.sent = cp.send(out, (r + 1) % n);
  x.received = cp.recv(x.incoming, (r + n - 1) % n);
  group.close();
  return x;
}

// k and v as one flat buffer (one message a step), and back.
at::Tensor ring_pack(const at::Tensor& a, const at::Tensor& b) {
  return at::cat({a.reshape(-1), b.reshape(-1)});
}
std::pair<at::Tensor, at::Tensor> ring_unpack(const at::Tensor& flat, at::IntArrayRef a,
                                              at::IntArrayRef b) {
  const int64_t na = c10::multiply_integers(a);
  return {flat.narrow(0, 0, na).view(a), flat.narrow(0, na, flat.numel() - na).view(b)};
}

at::ScalarType ring_acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Lowest finite value of the accumulator dtypes: x - it stays -inf for x = -inf (no NaN from
// -inf - -inf in rows that have seen no key yet).
constexpr double kRingLowest = std::numeric_limits<float>::lowest();

// What one rank's pass over a block needs.
struct RingArgs {
  at::Tensor q;
  bool causal;
  double scale;
  int rank, size;
  at::ScalarType acc;
};

// The causal mask of a query run against a key run by their global positions: nullopt when the
// key run lies entirely in the future (skip the pair), an undefined tensor when it is entirely
// visible, else [len_q, len_k] true where the key is visible.
std::optional<at::Tensor> ring_mask(const CpSegment& qs, const CpSegment& ks, bool causal,
                                    const at::Device& dev) {
  if (!causal || ks.global + ks.len - 1 <= qs.global) return at::Tensor();
  if (ks.global > qs.global + qs.len - 1) return std::nullopt;
  auto opts = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor qpos = at::arange(qs.global, qs.global + qs.len, opts);
  at::Tensor kpos = at::arange(ks.global, ks.global + ks.len, opts);
  return qpos.unsqueeze(1) >= kpos.unsqueeze(0);
}

// Scores of a query run against a key run, scaled and masked, in the accumulator dtype.
at::Tensor ring_scores(const RingArgs& a, const at::Tensor& qr, const at::Tensor& kr,
                       const at::Tensor& mask) {
  at::Tensor s = at::matmul(qr, kr.transpose(-2, -1)).to(a.acc).mul_(a.scale);
  if (mask.defined()) s.masked_fill_(mask.logical_not(), -std::numeric_limits<double>::infinity());
  return s;
}

// ---- forward -------------------------------------------------------------------------------
// The online-softmax merge of a block's (o_b, lse_b) into the running (out, lse), in place.
void ring_merge(at::Tensor out, at::Tensor lse, const at::Tensor& o_b, const at::Tensor& lse_b) {
  at::Tensor m = at::logaddexp(lse, lse_b);
  at::Tensor m_safe = m.clamp_min(kRingLowest);
  out.mul_(at::exp(lse - m_safe).unsqueeze(-1)).add_(o_b * at::exp(lse_b - m_safe).unsqueeze(-1));
  lse.copy_(m);
}

// Merges every unmasked pair of this rank's query tiles with the key/value tiles of the block
// of rank src.
void ring_forward_block(const RingArgs& a, const at::Tensor& kb, const at::Tensor& vb, int src,
                        at::Tensor& out, at::Tensor& lse) {
  const int64_t s_local = a.q.size(2);
  const std::vector<CpSegment> key_tiles = ring_tiles(s_local, src, a.size, a.causal);
  for (const CpSegment& qs : ring_tiles(s_local, a.rank, a.size, a.causal)) {
    for (const CpSegment& ks : key_tiles) {
      std::optional<at::Tensor> mask = ring_mask(qs, ks, a.causal, a.q.device());
      if (!mask) continue;  // entirely in the future
      at::Tensor s =
          ring_scores(a, a.q.narrow(2, qs.local, qs.len), kb.narrow(2, ks.local, ks.len), *mask);
      at::Tensor lse_b = at::logsumexp(s, -1);
      at::Tensor p = at::exp(s - lse_b.clamp_min(kRingLowest).unsqueeze(-1));
      at::Tensor o_b = at::matmul(p.to(vb.scalar_type()), vb.narrow(2, ks.local, ks.len)).to(a.acc);
      ring_merge(out.narrow(2, qs.local, qs.len), lse.narrow(2, qs.local, qs.len), o_b, lse_b);
    }
  }
}

// ---- backward ------------------------------------------------------------------------------
// What backward reads for this rank's queries, and the query gradient it accumulates.
struct RingGrads {
  at::Tensor dout, lse, delta;  // dO (input dtype), log-sum-exp and rowsum(dO * O) (acc)
  at::Tensor dq;                // acc
};

// Adds the block of rank src's contribution to dq (in g) and to that block's dk, dv.
void ring_backward_block(const RingArgs& a, RingGrads& g, const at::Tensor& kb,
                         const at::Tensor& vb, int src, at::Tensor& dkb, at::Tensor& dvb) {
  const int64_t s_local = a.q.size(2);
  const at::ScalarType in = a.q.scalar_type();
  const std::vector<CpSegment> key_tiles = ring_tiles(s_local, src, a.size, a.causal);
  for (const CpSegment& qs : ring_tiles(s_local, a.rank, a.size, a.causal)) {
    for (const CpSegment& ks : key_tiles) {
      std::optional<at::Tensor> mask = ring_mask(qs, ks, a.causal, a.q.device());
      if (!mask) continue;
      at::Tensor qr = a.q.narrow(2, qs.local, qs.len), kr = kb.narrow(2, ks.local, ks.len);
      at::Tensor vr = vb.narrow(2, ks.local, ks.len), dor = g.dout.narrow(2, qs.local, qs.len);
      at::Tensor lse = g.lse.narrow(2, qs.local, qs.len).clamp_min(kRingLowest);
      at::Tensor p = at::exp(ring_scores(a, qr, kr, *mask) - lse.unsqueeze(-1));  // 0 where masked
      dvb.narrow(2, ks.local, ks.len).add_(at::matmul(p.transpose(-2, -1).to(in), dor).to(a.acc));
      at::Tensor dp = at::matmul(dor, vr.transpose(-2, -1)).to(a.acc);
      at::Tensor ds = p.mul_(dp.sub_(g.delta.narrow(2, qs.local, qs.len).unsqueeze(-1)));
      g.dq.narrow(2, qs.local, qs.len).add_(at::matmul(ds.to(in), kr).to(a.acc), a.scale);
      dkb.narrow(2, ks.local, ks.len)
          .add_(at::matmul(ds.transpose(-2, -1).to(in), qr).to(a.acc), a.scale);
    }
  }
}

// The ring of backward: the key/value blocks travel as in forward; each block's dk/dv partial
// sum travels one step behind it, gaining this rank's share, and after C steps arrives home.
// Returns this rank's own dk and dv (flat, acc dtype).
at::Tensor ring_backward_ring(const RingArgs& a, RingGrads& g, const at::Tensor& k,
                              const at::Tensor& v, dist::Communicator& cp) {
  const int n = a.size;
  at::Tensor kv = ring_pack(k, v);
  std::optional<RingExchange> dkv_in;
  at::Tensor dkv;
  for (int t = 0; t < n; ++t) {
    std::optional<RingExchange> kv_next;
    if (t + 1 < n) kv_next = ring_exchange(cp, kv, t);  // in flight while this block is computed
    const RingClock::time_point start = RingClock::now();
    auto [kb, vb] = ring_unpack(kv, k.sizes(), v.sizes());
    dkv = at::zeros({kv.numel()}, kv.options().dtype(a.acc));
    auto [dkb, dvb] = ring_unpack(dkv, k.sizes(), v.sizes());
    ring_backward_block(a, g, kb, vb, (a.rank - t + n) % n, dkb, dvb);
    ring_record("ring backward", t, start);
    if (dkv_in) dkv.add_(dkv_in->wait());  // the ranks before this one's share of this block
    if (n > 1) dkv_in = ring_exchange(cp, dkv, t);
    if (kv_next) kv = kv_next->wait();
  }
  return n > 1 ? dkv_in->wait() : dkv;
}

struct RingAttentionFn : torch::autograd::Function<RingAttentionFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, bool causal, int64_t comm, double scale) {
    dist::Communicator& cp = comm_from(comm);
    const RingArgs a{q, causal, scale, cp.rank(), cp.size(), ring_acc_dtype(q.scalar_type())};
    std::vector<int64_t> out_shape = {q.size(0), q.size(1), q.size(2), v.size(3)};
    at::Tensor acc_out = at::zeros(out_shape, q.options().dtype(a.acc));
    at::Tensor lse = at::full({q.size(0), q.size(1), q.size(2)},
                              -std::numeric_limits<double>::infinity(), q.options().dtype(a.acc));
    at::Tensor kv = ring_pack(k, v);
    for (int t = 0; t < a.size; ++t) {
      std::optional<RingExchange> next;
      if (t + 1 < a.size) next = ring_exchange(cp, kv, t);  // in flight while this block is computed
      const RingClock::time_point start = RingClock::now();
      auto [kb, vb] = ring_unpack(kv, k.sizes(), v.sizes());
      ring_forward_block(a, kb, vb, (a.rank - t + a.size) % a.size, acc_out, lse);
      ring_record("ring forward", t, start);
      if (next) kv = next->wait();
    }
    at::Tensor out = acc_out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["tp"] = comm;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    dist::Communicator& cp = comm_of(ctx);
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const RingArgs a{q,
                     ctx->saved_data["causal"].toBool(),
                     ctx->saved_data["scale"].toDouble(),
                     cp.rank(),
                     cp.size(),
                     ring_acc_dtype(q.scalar_type())};
    RingGrads g;
    g.dout = grads[0].to(q.scalar_type()).contiguous();
    g.lse = saved[4];
    g.delta = (g.dout.to(a.acc) * out.to(a.acc)).sum(-1);  // FlashAttention's D = rowsum(dO * O)
    g.dq = at::zeros(q.sizes(), q.options().dtype(a.acc));
    at::Tensor dkv = ring_backward_ring(a, g, k, v, cp);
    auto [dk, dv] = ring_unpack(dkv, k.sizes(), v.sizes());
    return {g.dq.to(q.scalar_type()),
            dk.to(k.scalar_type()),
            dv.to(v.scalar_type()),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

void ring_check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                       dist::Communicator& cp) {
  DTRAIN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
               "ring_attention: q, k and v must be [B, H, S_local, D], got ", q.sizes(), ", ",
               k.sizes(), " and ", v.sizes());
  DTRAIN_CHECK(
      k.sizes() == q.sizes() && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
      "ring_attention: k must have q's shape and v q's first three sizes (B, H, S_local), got q ",
      q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  DTRAIN_CHECK(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                   v.scalar_type() == q.scalar_type(),
               "ring_attention: q, k and v must have one floating dtype, got ", q.scalar_type(),
               ", ", k.scalar_type(), " and ", v.scalar_type());
  DTRAIN_CHECK(k.device() == q.device() && v.device() == q.device(),
               "ring_attention: q, k and v must be on one device, got ", q.device(), ", ",
               k.device(), " and ", v.device());
  DTRAIN_CHECK(cp.size() == 1 || cp.supports(q.device().type()),
               "ring_attention: the communicator '", cp.name(), "' (", cp.backend(),
               ") does not carry tensors on ", q.device());
  DTRAIN_CHECK(!causal || cp.size() == 1 || q.size(2) % 2 == 0,
               "ring_attention: causal attention over C=", cp.size(),
               " context-parallel ranks needs the local sequence in two equal chunks, but S_local=",
               q.size(2),
               " is odd; split a sequence whose length is a multiple of 2C with cp_split_sequence");
}

}  // namespace

void set_ring_tracing(bool on) { g_ring_tracing.store(on); }

std::vector<RingEvent> take_ring_events() {
  std::lock_guard<std::mutex> lock(g_ring_mutex);
  std::vector<RingEvent> out;
  out.swap(g_ring_events);
  return out;
}

at::Tensor cp_split_sequence(const at::Tensor& x, int64_t dim, int cp_rank, int cp_size) {
  dim = checked_dim(x, dim, "cp_split_sequence");
  cp_check_layout(x.size(dim), cp_rank, cp_size, "cp_split_sequence");
  if (cp_size == 1) return x.contiguous();
  const int64_t c = x.size(dim) / (2 * cp_size);
  return at::cat({x.narrow(dim, cp_rank * c, c), x.narrow(dim, (2 * cp_size - 1 - cp_rank) * c, c)},
                 dim);
}

at::Tensor cp_positions(int64_t seq_len, int cp_rank, int cp_size,
                        const at::TensorOptions& options) {
  DTRAIN_CHECK(seq_len >= 0, "cp_positions: a sequence length cannot be negative, got ", seq_len);
  cp_check_layout(seq_len, cp_rank, cp_size, "cp_positions");
  if (cp_size == 1) return at::arange(seq_len, options);
  const int64_t c = seq_len / (2 * cp_size);
  const int64_t front = cp_rank * c, back = (2 * cp_size - 1 - cp_rank) * c;
  return at::cat({at::arange(front, front + c, options), at::arange(back, back + c, options)});
}

at::Tensor cp_gather_sequence(const at::Tensor& local, int64_t dim, dist::Communicator& cp) {
  dim = checked_dim(local, dim, "cp_gather_sequence");
  const int n = cp.size();
  DTRAIN_CHECK(n == 1 || local.size(dim) % 2 == 0,
               "cp_gather_sequence: a rank's part of the sequence is two ",
               "equal chunks, but dimension ", dim, " of ", local.sizes(), " is odd");
  at::Tensor rows = all_gather_along(local.detach(), dim, cp);  // rank 0's tokens, rank 1's, ...
  if (n == 1) return rows;
  const int64_t seq_len = rows.size(dim);
  std::vector<at::Tensor> where;  // the global position of each gathered row
  for (int r = 0; r < n; ++r)
    where.push_back(cp_positions(seq_len, r, n, at::TensorOptions().dtype(at::kLong)));
  at::Tensor order = at::argsort(at::cat(where)).to(rows.device());
  return rows.index_select(dim, order);
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          bool causal, dist::Communicator& cp, std::optional<double> scale) {
  ring_check_inputs(q, k, v, causal, cp);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  return RingAttentionFn::apply(q, k, v, causal, comm_handle(&cp), s);
}

int64_t ring_attention_saved_bytes(int64_t batch, int64_t heads, int64_t s_local, int64_t head_dim,
                                   at::ScalarType dtype) {
  const int64_t rows = batch * heads * s_local;
  return 4 * rows * head_dim * static_cast<int64_t>(c10::elementSize(dtype)) +
         rows * static_cast<int64_t>(c10::elementSize(ring_acc_dtype(dtype)));
}

int64_t ring_attention_saved_bytes_of(const at::Tensor& output) {
  auto* node = dynamic_cast<torch::autograd::CppNode<RingAttentionFn>*>(output.grad_fn().get());
  if (node == nullptr) return 0;
  int64_t bytes = 0;
  for (const at::Tensor& t : node->ctx_.get_saved_variables())
    bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

}  // namespace dtrain::engine
