// Context parallelism: a long sequence split across the C ranks of a context-parallel group,
// with attention still exact over the whole sequence (ring attention: Liu et al., "Ring
// Attention with Blockwise Transformers"; the load-balanced layout of Megatron-Core and
// torchtitan).
//
// Layout. The sequence of S tokens is cut into 2C equal chunks of S/(2C) tokens; rank r holds
// chunk r and chunk 2C-1-r, end to end (S/C tokens). Under a causal mask every rank then has
// the same amount of work (an early chunk with little history paired with a late one with
// much). Every tensor of the sequence (tokens, positions, activations, q/k/v) uses this
// layout along its sequence dimension; cp_split_sequence makes it, cp_gather_sequence undoes
// it, cp_positions gives the global positions of a rank's tokens (for rotary or learned
// position embeddings). A group of one rank holds the whole sequence in order, for any S.
//
// Attention. ring_attention computes this rank's rows of softmax(q k^T * scale + mask) v over
// the whole sequence. The key/value blocks travel around the ring (rank r sends to r+1 and
// receives from r-1, C-1 times), each block computed while the next one is in flight; the
// partial results are merged by the online-softmax rule (log-sum-exp), and under a causal mask
// the query and key tokens are compared by their global positions, a block pair entirely in
// the future being skipped. For backward it keeps q, k, v, the output and the per-row
// log-sum-exp (no S x S matrix): memory per rank falls as 1/C. Backward recomputes each block
// pair from the log-sum-exp (FlashAttention's backward); the key/value gradients travel with
// their block and arrive, after the ring, on the rank that owns those keys and values.
//
// Numerics: the matrix products run in the inputs' dtype; the softmax statistics, the output
// accumulator and the gradient accumulators are float64 for float64 inputs and float32
// otherwise (the gradients travelling around the ring too). No other casts.
//
// Errors: shapes that do not fit the layout throw dtrain::Error naming the sizes and the fix,
// before any communication.
//
// Threading and ordering: ring_attention's forward and backward issue point-to-point sends and
// receives on the group's communicator (in begin_group()/end_group() pairs, so NCCL pairs
// them), the same sequence on every rank of the group; like any collective they must be
// called by every rank of the group in the same order, from one thread at a time. The
// communicator must outlive the autograd graph. Every rank must pass tensors of the same
// shape and dtype. A group of one rank communicates nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"

namespace dtrain::engine {

// ---- the layout --------------------------------------------------------------------------
// This rank's tokens of a whole-sequence tensor x: chunks cp_rank and 2*cp_size-1-cp_rank of
// dimension dim (negative counts from the end), concatenated (a new contiguous tensor, part of
// the autograd graph). Throws dtrain::Error, naming S, C and the fix, when x.size(dim) is not a
// multiple of 2*cp_size (cp_size > 1), or for a rank outside [0, cp_size).
at::Tensor cp_split_sequence(const at::Tensor& x, int64_t dim, int cp_rank, int cp_size);

// The global positions (0 .. seq_len-1) of this rank's tokens, in the order cp_split_sequence
// puts them: [cp_rank*c, (cp_rank+1)*c) then [(2C-1-cp_rank)*c, (2C-cp_rank)*c) with
// c = seq_len / (2C). Same errors as cp_split_sequence.
at::Tensor cp_positions(int64_t seq_len, int cp_rank, int cp_size,
                        const at::TensorOptions& options = at::TensorOptions().dtype(at::kLong));

// The inverse of cp_split_sequence over the group: the whole sequence on every rank (one
// all_gather, then the chunks put back in order). Collective and synchronous; not part of the
// autograd graph (for tests and evaluation). Every rank must pass the same shape.
at::Tensor cp_gather_sequence(const at::Tensor& local, int64_t dim, dist::Communicator& cp);

// ---- attention ---------------------------------------------------------------------------
// q [B, H, S_local, D], k [B, H, S_local, D], v [B, H, S_local, Dv] in the layout above
// (S_local = S / C, C = cp.size()), one floating dtype, on a device the communicator serves.
// Returns [B, H, S_local, Dv]: this rank's rows of softmax(q k^T * scale + mask) v over the
// whole sequence, where mask hides keys at a later global position than the query when
// causal. scale defaults to 1/sqrt(D). Differentiable in q, k and v (a custom autograd
// function; its backward runs the ring again). Throws dtrain::Error for shapes that do not
// match, mixed dtypes or devices, or an odd S_local under a causal mask with C > 1.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          bool causal, dist::Communicator& cp,
                          std::optional<double> scale = std::nullopt);

// ---- tracing (the timeline) --------------------------------------------------------------
// While tracing is on, ring_attention records its ring steps: each block's computation ("ring
// forward" / "ring backward", step t of 0..C-1) and each exchange from its launch to the end
// of the wait for it ("ring exchange": hidden where a block's computation overlaps it). The
// Trainer turns it on for a timeline under --cp and puts the events on the lane "ring".
// Thread-safe (backward may run on autograd's threads).
struct RingEvent {
  std::string name;
  int step = 0;
  std::chrono::steady_clock::time_point start, end;
};
void set_ring_tracing(bool on);
// The events recorded since the last call, oldest first.
std::vector<RingEvent> take_ring_events();

// The bytes ring_attention keeps for backward per rank, for q, k, v and the output of
// [B, H, S_local, D] in `dtype`: 4 B H S_local D elements of dtype and B H S_local log-sum-exp
// values (float64 for float64, float32 otherwise). Linear in S_local = S/C, so it falls as 1/C
// at a fixed S; there is no S x S term. For the memory planner and the tests.
int64_t ring_attention_saved_bytes(int64_t batch, int64_t heads, int64_t s_local, int64_t head_dim,
                                   at::ScalarType dtype);
// The bytes actually held for backward by the ring_attention node that produced `output`
// (the sum of its saved tensors' sizes; 0 when output has no such node or was made without
// gradients). Read it before backward, which releases them.
int64_t ring_attention_saved_bytes_of(const at::Tensor& output);

}  // namespace dtrain::engine
