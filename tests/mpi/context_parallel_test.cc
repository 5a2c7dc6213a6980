// Context parallelism: the load-balanced layout against hand-written positions, and ring
// attention against the whole-sequence attention computed on every rank in float64 with plain
// ATen ops (softmax(q k^T scale + mask) v, gradients by autograd) on the same seeded inputs, at
// the world size (2 and 4): output and dq, dk, dv within 1e-10, causal and not; a group of one
// against plain attention without communication; the messages the ring sends; the memory kept
// for backward (exactly 1/C of the one-rank run's); sequences the layout cannot split, refused.
// And the library's GPT and Llama given a context-parallel group (alone, with a data-parallel
// axis beside it, and with tensor and sequence parallelism): logits, loss and every gradient
// equal the unsplit model's in float64.
#include "dtrain/engine/parallel/context_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/train/trainer.h"
#include "model_cases.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::same_everywhere;
using testing_util::world_comm;

constexpr double cp_t_kTol = 1e-10;

// The largest absolute difference, in float64.
double cp_t_max_diff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.detach().to(at::kDouble) - b.detach().to(at::kDouble)).abs().max().item<double>();
}

// The reference: whole-sequence attention with plain ATen ops.
at::Tensor cp_t_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          bool causal, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (causal) {
    const int64_t n = q.size(2);
    at::Tensor future = at::ones({n, n}, at::TensorOptions().dtype(at::kBool)).triu(1);
    s = s.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  return at::matmul(at::softmax(s, -1), v);
}

struct CpTCase {
  int64_t B = 2, H = 3, S = 0, D = 5, Dv = 5;
  bool causal = false;
  std::optional<double> scale;
  at::ScalarType dtype = at::kDouble;
};

struct CpTResult {
  double out = 0, gathered = 0, dq = 0, dk = 0, dv = 0;
};

// ring_attention over cp on this rank's part of seeded whole-sequence inputs, against the
// reference on the whole: the largest differences of output (local and gathered) and gradients.
CpTResult cp_t_compare(const CpTCase& c, dist::Communicator& cp, uint64_t seed) {
  const int r = cp.rank(), n = cp.size();
  at::Tensor q = same_everywhere({c.B, c.H, c.S, c.D}, seed);
  at::Tensor k = same_everywhere({c.B, c.H, c.S, c.D}, seed + 1);
  at::Tensor v = same_everywhere({c.B, c.H, c.S, c.Dv}, seed + 2);
  at::Tensor up = same_everywhere({c.B, c.H, c.S, c.Dv}, seed + 3);  // the upstream gradient
  auto local = [&](const at::Tensor& x) {
    return cp_split_sequence(x, 2, r, n).to(c.dtype).detach().requires_grad_(true);
  };
  at::Tensor ql = local(q), kl = local(k), vl = local(v);
  at::Tensor out = ring_attention(ql, kl, vl, c.causal, cp, c.scale);
  EXPECT_EQ(out.scalar_type(), c.dtype);
  (out * cp_split_sequence(up, 2, r, n).to(c.dtype)).sum().backward();

  at::Tensor qr = q.clone().requires_grad_(true), kr = k.clone().requires_grad_(true);
  at::Tensor vr = v.clone().requires_grad_(true);
  at::Tensor ref =
      cp_t_reference(qr, kr, vr, c.causal, c.scale.value_or(1.0 / std::sqrt(double(c.D))));
  (ref * up).sum().backward();
  auto mine = [&](const at::Tensor& x) { return cp_split_sequence(x, 2, r, n); };
  CpTResult res;
  res.out = cp_t_max_diff(out, mine(ref));
  res.gathered = cp_t_max_diff(cp_gather_sequence(out, 2, cp), ref);
  res.dq = cp_t_max_diff(ql.grad(), mine(qr.grad()));
  res.dk = cp_t_max_diff(kl.grad(), mine(kr.grad()));
  res.dv = cp_t_max_diff(vl.grad(), mine(vr.grad()));
  EXPECT_EQ(ql.grad().scalar_type(), c.dtype);
  return res;
}

void cp_t_expect_within(const CpTResult& res, double tol, const std::string& what) {
  EXPECT_LT(res.out, tol) << what << ": output";
  EXPECT_LT(res.gathered, tol) << what << ": gathered output";
  EXPECT_LT(res.dq, tol) << what << ": dq";
  EXPECT_LT(res.dk, tol) << what << ": dk";
  EXPECT_LT(res.dv, tol) << what << ": dv";
}

TEST(ContextParallelLayout, PositionsAndSplitMatchTheHandWrittenLayout) {
  // S = 8, C = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (every process checks both).
  const std::vector<std::vector<int64_t>> c2 = {{0, 1, 6, 7}, {2, 3, 4, 5}};
  at::Tensor seq = at::arange(8, at::kLong);
  at::Tensor batch = at::arange(16, at::kLong).view({2, 8});  // two sequences, tokens along dim 1
  for (int r = 0; r < 2; ++r) {
    at::Tensor want = at::tensor(c2[r], at::kLong);
    EXPECT_TRUE(at::equal(cp_positions(8, r, 2), want))
        << "rank " << r << ": " << cp_positions(8, r, 2);
    EXPECT_TRUE(at::equal(cp_split_sequence(seq, 0, r, 2), want)) << "rank " << r;
    EXPECT_TRUE(at::equal(cp_split_sequence(batch, 1, r, 2), at::stack({want, want + 8})));
    EXPECT_TRUE(at::equal(cp_split_sequence(batch, -1, r, 2), at::stack({want, want + 8})));
  }
  // S = 8, C = 4: chunks of one token, rank r holds r and 7 - r.
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(
        at::equal(cp_positions(8, r, 4), at::tensor(std::vector<int64_t>{r, 7 - r}, at::kLong)));
  }
  // A group of one holds the sequence in order, whatever its length.
  EXPECT_TRUE(at::equal(cp_positions(7, 0, 1), at::arange(7, at::kLong)));
  EXPECT_TRUE(at::equal(cp_split_sequence(seq, 0, 0, 1), seq));
  // Positions in another dtype.
  EXPECT_EQ(cp_positions(8, 1, 2, at::TensorOptions().dtype(at::kInt)).scalar_type(), at::kInt);
}

TEST(ContextParallelLayout, GatherUndoesTheSplitOverTheWorld) {
  auto& cp = world_comm();
  const int n = cp.size();
  at::Tensor x = same_everywhere({3, 4 * n, 2}, 41);
  for (int64_t dim : {1, -2}) {
    at::Tensor local = cp_split_sequence(x, dim, cp.rank(), n);
    EXPECT_TRUE(at::equal(local, cp_split_sequence(x, 1, cp.rank(), n)));
    EXPECT_TRUE(at::equal(cp_gather_sequence(local, dim, cp), x)) << "dim " << dim;
    // The positions say where each local token came from.
    EXPECT_TRUE(at::equal(local, x.index_select(1, cp_positions(4 * n, cp.rank(), n))));
  }
}

TEST(ContextParallelLayout, ASequenceThatDoesNotSplitIsRefusedWithTheFix) {
  at::Tensor x = at::zeros({2, 10, 3});
  const std::string split = testing_util::error_of([&] { cp_split_sequence(x, 1, 0, 4); });
  EXPECT_NE(split.find("S=10"), std::string::npos) << split;
  EXPECT_NE(split.find("C=4"), std::string::npos) << split;
  EXPECT_NE(split.find("multiple of 2C=8"), std::string::npos) << split;
  EXPECT_NE(split.find("multiple of 2 x --cp"), std::string::npos) << split;
  EXPECT_TRUE(testing_util::throws_error_with([] { cp_positions(6, 1, 2); }, "S=6"));
  EXPECT_TRUE(
      testing_util::throws_error_with([] { cp_positions(8, 2, 2); }, "rank 2 is not a rank"));
  EXPECT_TRUE(
      testing_util::throws_error_with([&] { cp_split_sequence(x, 3, 0, 1); }, "out of range"));
  // ring_attention refuses an odd local sequence under a causal mask, on every rank, before
  // any communication.
  auto& cp = world_comm();
  at::Tensor odd = at::zeros({1, 1, 3, 2}, at::kDouble);
  if (cp.size() > 1) {
    EXPECT_TRUE(testing_util::throws_error_with([&] { ring_attention(odd, odd, odd, true, cp); },
                                                "S_local=3"));
  }
  at::Tensor other = at::zeros({1, 1, 4, 2}, at::kDouble);
  EXPECT_TRUE(testing_util::throws_error_with([&] { ring_attention(other, odd, odd, false, cp); },
                                              "k must have"));
  EXPECT_TRUE(testing_util::throws_error_with(
      [&] { ring_attention(other, other, other.to(at::kFloat), false, cp); },
      "one floating dtype"));
}

TEST(ContextParallelRingAttention, OutputAndGradientsMatchTheWholeSequenceInFloat64) {
  auto& cp = world_comm();
  const int n = cp.size();
  uint64_t seed = 100;
  for (bool causal : {false, true}) {
    CpTCase c;
    c.S = 4 * n;  // chunks of two tokens
    c.causal = causal;
    cp_t_expect_within(cp_t_compare(c, cp, seed += 10), cp_t_kTol, causal ? "causal" : "full");
    // Longer chunks, another value width and an explicit scale.
    c.B = 1, c.H = 2, c.S = 2 * n * 7, c.D = 8, c.Dv = 3, c.scale = 0.3;
    cp_t_expect_within(cp_t_compare(c, cp, seed += 10), cp_t_kTol,
                       causal ? "causal, Dv=3" : "full, Dv=3");
  }
}

TEST(ContextParallelRingAttention, Float32StaysFloat32AndCloseToTheReference) {
  auto& cp = world_comm();
  CpTCase c;
  c.S = 6 * cp.size();
  c.dtype = at::kFloat;
  for (bool causal : {false, true}) {
    c.causal = causal;
    cp_t_expect_within(cp_t_compare(c, cp, causal ? 300 : 310), 1e-5,
                       causal ? "float32 causal" : "float32");
  }
}

TEST(ContextParallelRingAttention, AGroupOfOneIsPlainAttentionWithoutCommunication) {
  auto alone = testing_util::alone_comm();
  for (bool causal : {false, true}) {
    CpTCase c;
    c.S = 7;  // any length for one rank
    c.causal = causal;
    cp_t_expect_within(cp_t_compare(c, *alone, causal ? 400 : 410), cp_t_kTol,
                       causal ? "alone causal" : "alone");
  }
  // No message went anywhere: the first send to itself is send #1.
  at::Tensor got = at::empty({2});
  dist::WorkPtr received = alone->recv(got, 0);
  EXPECT_EQ(alone->send(at::ones({2}), 0)->sequence(), 1u);
  received->wait();
  EXPECT_EQ(alone->traffic().ops, 0u);
}

TEST(ContextParallelRingAttention, KeysAndValuesGoRoundTheRingOnceEachWay) {
  auto& cp = world_comm();
  const int n = cp.size();
  const int64_t B = 1, H = 2, S = 4 * n, D = 3;
  at::Tensor q =
      cp_split_sequence(same_everywhere({B, H, S, D}, 51), 2, cp.rank(), n).requires_grad_(true);
  at::Tensor k =
      cp_split_sequence(same_everywhere({B, H, S, D}, 52), 2, cp.rank(), n).requires_grad_(true);
  const double kv_bytes = 2.0 * static_cast<double>(k.numel()) * 8;
  const dist::CommTraffic before = cp.traffic();
  at::Tensor out = ring_attention(q, k, k, true, cp);
  const dist::CommTraffic forward = cp.traffic();
  // Forward: C-1 sends of this rank's current k and v (one message a step).
  EXPECT_EQ(forward.ops - before.ops, static_cast<uint64_t>(n - 1));
  EXPECT_DOUBLE_EQ(forward.payload_bytes - before.payload_bytes, (n - 1) * kv_bytes);
  out.sum().backward();
  // Backward: the blocks again (C-1), and their gradients C times (home at the end).
  const dist::CommTraffic after = cp.traffic();
  EXPECT_EQ(after.ops - forward.ops, static_cast<uint64_t>(2 * n - 1));
  EXPECT_DOUBLE_EQ(after.payload_bytes - forward.payload_bytes, (2 * n - 1) * kv_bytes);
}

TEST(ContextParallelRingAttention, MemoryKeptForBackwardFallsAsOneOverC) {
  auto& cp = world_comm();
  const int n = cp.size();
  const int64_t B = 1, H = 2, S = 8 * n, D = 4;
  // By hand: q, k, v and the output (4 x B H S_local D float64) and a float64 log-sum-exp per row.
  EXPECT_EQ(ring_attention_saved_bytes(1, 2, 8, 4, at::kDouble), 4 * 16 * 4 * 8 + 16 * 8);
  EXPECT_EQ(ring_attention_saved_bytes(1, 2, 8, 4, at::kFloat), 4 * 16 * 4 * 4 + 16 * 4);
  EXPECT_EQ(ring_attention_saved_bytes(1, 2, 8, 4, at::kBFloat16), 4 * 16 * 4 * 2 + 16 * 4);
  auto run = [&](dist::Communicator& group) {
    auto part = [&](uint64_t seed) {
      at::Tensor whole = same_everywhere({B, H, S, D}, seed);
      return cp_split_sequence(whole, 2, group.rank(), group.size()).requires_grad_(true);
    };
    at::Tensor q = part(61), k = part(62), v = part(63);
    at::Tensor out = ring_attention(q, k, v, true, group);
    const int64_t bytes = ring_attention_saved_bytes_of(out);
    out.sum().backward();  // the ring's backward runs on every rank of the group
    return bytes;
  };
  auto alone = testing_util::alone_comm();
  const int64_t whole = run(*alone);
  const int64_t split = run(cp);
  // The tensors the function really saved are what the formula says: no S x S term.
  EXPECT_EQ(whole, ring_attention_saved_bytes(B, H, S, D, at::kDouble));
  EXPECT_EQ(split, ring_attention_saved_bytes(B, H, S / n, D, at::kDouble));
  EXPECT_EQ(split * n, whole) << "C=" << n;
  // Nothing is saved without gradients.
  at::Tensor plain = cp_split_sequence(same_everywhere({B, H, S, D}, 64), 2, cp.rank(), n);
  EXPECT_EQ(ring_attention_saved_bytes_of(ring_attention(plain, plain, plain, false, cp)), 0);
}

// Chunks longer than the tile ring attention works in (512 tokens; 1100 here: two whole tiles
// and a part) give the whole-sequence attention too, causal and not, in the group and alone.
TEST(ContextParallelRingAttention, ChunksLongerThanATileEqualTheWholeAttention) {
  auto& cp = world_comm();
  auto alone = testing_util::alone_comm();
  for (bool causal : {true, false}) {
    CpTCase c;
    c.B = 1;
    c.H = 1;
    c.D = c.Dv = 4;
    c.S = 2 * cp.size() * 1100;
    c.causal = causal;
    cp_t_expect_within(cp_t_compare(c, cp, 71), cp_t_kTol, causal ? "causal, long" : "long");
    c.S = 1100 + 300;
    cp_t_expect_within(cp_t_compare(c, *alone, 72), cp_t_kTol, causal ? "causal, long, alone" : "long, alone");
  }
}

// What forward and backward allocate beyond the saved tensors is bounded by the tiles: the peak
// above the start grows linearly with the sequence (doubling S about doubles it; whole chunk
// pairs of scores would quadruple it). Exact on the CPU (dtrain's counting allocator).
TEST(ContextParallelRingAttention, PeakMemoryGrowsLinearlyWithTheSequence) {
  auto& cp = world_comm();
  if (!cpu_memory_tracked()) GTEST_SKIP() << "CPU memory is not counted (DTRAIN_TRACK_CPU_MEMORY=0)";
  const c10::Device cpu(c10::kCPU);
  auto peak_of = [&](int64_t s_local) {
    const int64_t S = s_local * cp.size();
    auto part = [&](uint64_t seed) {
      return cp_split_sequence(same_everywhere({1, 2, S, 8}, seed).to(at::kFloat), 2, cp.rank(), cp.size())
          .requires_grad_(true);
    };
    at::Tensor q = part(81), k = part(82), v = part(83);
    const double before = memory_stats(cpu).allocated_mb;
    reset_peak_memory(cpu);
    ring_attention(q, k, v, true, cp).sum().backward();
    return memory_stats(cpu).peak_mb - before;
  };
  peak_of(2048);  // warm-up
  const double small = peak_of(4096), large = peak_of(8192);
  if (cp.rank() == 0) std::cout << "[ cp peak  ] S_local 4096: " << small << " MiB, 8192: " << large << " MiB\n";
  EXPECT_LT(large, 2.5 * small) << "the peak grows faster than the sequence";
  // Whole chunk pairs: [1, 2, 4096, 4096] float32 scores alone are 128 MiB at S_local 8192.
  EXPECT_LT(large, 64.0);
}

// ---- the library's models over a context-parallel group -----------------------------------

struct CpTLayout {
  int cp = 1, tp = 1;
  bool sp = false;
  std::string name() const {
    return "cp " + std::to_string(cp) + " tp " + std::to_string(tp) + (sp ? " sequence-parallel" : "");
  }
};

// The layouts of the world: cp over all of it; at 4 ranks also cp 2 beside dp 2, and cp 2 x tp 2
// with and without sequence parallelism.
std::vector<CpTLayout> cp_t_layouts(int W) {
  std::vector<CpTLayout> out = {{W, 1, false}};
  if (W == 4) {
    out.push_back({2, 1, false});
    out.push_back({2, 2, false});
    out.push_back({2, 2, true});
  }
  return out;
}

// `model` (tp-split, cp-split: forward gives this rank's logits of its part of the sequence)
// against `ref` (whole, on this rank alone) on the same windows: the logits put together over tp
// and cp, the group's mean loss and every gradient averaged over cp (the full tensor gathered
// over tp) within 1e-10. Returns the worst relative error.
template <class Model>
double cp_t_check_model(Model& ref, Model& model, const dist::Mesh& mesh, int64_t vocab, int64_t S) {
  dist::Communicator& cp = mesh.cp();
  auto g = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor windows = at::randint(vocab, {3, S + 1}, g, at::kLong);
  at::Tensor inputs = windows.narrow(1, 0, S), targets = windows.narrow(1, 1, S);
  double worst = 0;
  {
    at::NoGradGuard no_grad;
    at::Tensor local = model.forward(inputs);
    EXPECT_EQ(local.size(1), S / cp.size()) << "the logits are not this rank's part of the sequence";
    at::Tensor got = cp_gather_sequence(model_cases::gather_logits(local, vocab, mesh.tp()), 1, cp);
    const double e = testing_util::rel_error(got, ref.forward(inputs));
    EXPECT_LT(e, cp_t_kTol) << "logits";
    worst = std::max(worst, e);
  }
  at::Tensor want_loss = ref.loss(inputs, targets);
  at::Tensor loss = model.loss(inputs, targets);
  at::Tensor mean = loss.detach().clone().reshape({1});
  cp.all_reduce(mean, dist::ReduceOp::kAvg)->wait();
  EXPECT_NEAR(mean.item<double>(), want_loss.item<double>(), cp_t_kTol * want_loss.item<double>()) << "loss";
  // Each rank's loss alone is not the whole sequence's (the test would pass without the split).
  if (cp.size() > 1) {
    at::Tensor spread = loss.detach().clone().reshape({1});
    cp.all_reduce(spread, dist::ReduceOp::kMax)->wait();
    EXPECT_GT(spread.item<double>() - mean.item<double>(), 1e-6) << "every rank's loss is the mean";
  }
  want_loss.backward();
  loss.backward();
  const auto specs = collect_shard_specs(model);
  auto ref_params = ref.named_parameters();
  for (auto& item : model.named_parameters()) {
    EXPECT_TRUE(item.value().grad().defined()) << item.key();
    if (!item.value().grad().defined()) return 1.0;
    at::Tensor grad = item.value().grad().detach().clone();
    cp.all_reduce(grad, dist::ReduceOp::kAvg)->wait();
    auto spec = specs.find(item.key());
    at::Tensor full = spec == specs.end() ? grad : gather_full_tensor(grad, spec->second, mesh.tp());
    const double e = testing_util::rel_error(full, ref_params[item.key()].grad());
    EXPECT_LT(e, cp_t_kTol) << item.key();
    worst = std::max(worst, e);
  }
  return worst;
}

// A small GPT's shape (dropout off, untied head).
GptOptions gpt_options(int64_t vocab, int64_t d_model, int64_t heads, int64_t ff, int64_t seq_len, int layers) {
  GptOptions o;
  o.vocab = vocab;
  o.d_model = d_model;
  o.heads = heads;
  o.ff = ff;
  o.seq_len = seq_len;
  o.layers = layers;
  return o;
}

TEST(ContextParallelModel, GptEqualsTheWholeModelInFloat64) {
  auto& world = world_comm();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (const CpTLayout& l : cp_t_layouts(world.size())) {
    SCOPED_TRACE(l.name());
    GptOptions o = gpt_options(51, 16, 4, 32, 16, 2);
    o.sequence_parallel = l.sp;
    auto alone = testing_util::alone_comm();
    dist::Mesh mesh(world, l.tp, 1, l.cp);
    ASSERT_EQ(mesh.cp_size(), l.cp);
    torch::manual_seed(3);
    GptImpl ref(o, *alone);
    ref.to(at::kDouble);
    GptImpl model(o, mesh.tp(), &mesh.cp());
    model.to(at::kDouble);
    {
      at::NoGradGuard no_grad;
      for (auto& item : ref.named_parameters()) item.value().normal_(0, 0.3);  // the same on every rank (seeded)
    }
    model_cases::load_reference_weights(ref, model, mesh.tp());
    const double worst = cp_t_check_model(ref, model, mesh, o.vocab, o.seq_len);
    if (world.rank() == 0) std::cout << "[ cp gpt   ] " << l.name() << ": worst rel " << worst << "\n";
  }
}

TEST(ContextParallelModel, LlamaWithGroupedQueriesEqualsTheWholeModelInFloat64) {
  auto& world = world_comm();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (const CpTLayout& l : cp_t_layouts(world.size())) {
    SCOPED_TRACE(l.name());
    // 8 query heads on 4 key/value heads, rotary positions with llama3 scaling.
    const LlamaOptions o = model_cases::split_llama_options(16, l.sp, false);
    auto alone = testing_util::alone_comm();
    dist::Mesh mesh(world, l.tp, 1, l.cp);
    torch::manual_seed(4);
    LlamaImpl ref(o, *alone);
    ref.to(at::kDouble);
    LlamaImpl model(o, mesh.tp(), &mesh.cp());
    model.to(at::kDouble);
    model_cases::draw_norm_weights(ref, 4);
    model_cases::load_reference_weights(ref, model, mesh.tp());
    const double worst = cp_t_check_model(ref, model, mesh, o.vocab, o.seq_len);
    if (world.rank() == 0) std::cout << "[ cp llama ] " << l.name() << ": worst rel " << worst << "\n";
  }
}

// A sequence that 2C chunks do not split is refused when the model is built, naming the numbers
// and the fix; so is decoding on a context-parallel Llama.
TEST(ContextParallelModel, ASequenceTheLayoutCannotSplitIsRefusedWithTheFix) {
  auto& world = world_comm();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  dist::Mesh mesh(world, 1, 1, world.size());
  GptOptions o = gpt_options(11, 8, 2, 16, 2 * world.size() + 2, 1);
  std::string e = testing_util::error_of([&] { GptImpl m(o, mesh.tp(), &mesh.cp()); });
  EXPECT_NE(e.find("--seq_len=" + std::to_string(o.seq_len) + " does not split into 2 x --cp=" +
                   std::to_string(world.size())),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("a multiple of " + std::to_string(2 * world.size())), std::string::npos) << e;
  LlamaOptions lo = model_cases::split_llama_options(2 * world.size() + 2, false, false);
  e = testing_util::error_of([&] { LlamaImpl m(lo, mesh.tp(), &mesh.cp()); });
  EXPECT_NE(e.find("does not split into 2 x --cp="), std::string::npos) << e;
  // Decoding a token at a time is refused on a context-parallel Llama.
  lo.seq_len = 2 * world.size();
  LlamaImpl llama(lo, mesh.tp(), &mesh.cp());
  e = testing_util::error_of([&] { llama.make_kv_cache(1, 4); });
  EXPECT_NE(e.find("the model is context-parallel"), std::string::npos) << e;
}

// A model split over a context-parallel group that is not the trainer's mesh's cp axis would
// train with each rank's own gradient (the replicas do not include that group): refused, naming
// the fix.
TEST(ContextParallelModel, TheTrainerRefusesAGroupThatIsNotTheMeshsCpAxis) {
  auto& world = world_comm();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  dist::Mesh split(world, 1, 1, world.size());
  dist::Mesh plain(world, 1);
  GptOptions o = gpt_options(11, 8, 2, 16, 2 * world.size(), 1);
  auto model = std::make_shared<GptImpl>(o, split.tp(), &split.cp());
  const std::string e = testing_util::error_of([&] { Trainer t(gpt_spec(model), plain, c10::Device(c10::kCPU), {}); });
  EXPECT_NE(e.find("is not the mesh's cp axis (1 rank(s))"), std::string::npos) << e;
  EXPECT_NE(e.find("the model with &mesh.cp()"), std::string::npos) << e;
}

// The replicas of the standard mesh with cp: dp x cp, ordered by (dp rank, cp rank), by the
// closed form r = ((p D + d) C + c) T + t; without cp, the data-parallel group itself.
TEST(ContextParallelModel, TheMeshsReplicasAreDataTimesContextParallelRanks) {
  auto& world = world_comm();
  const int W = world.size(), r = world.rank();
  auto members = [&](dist::Communicator& c) {
    at::Tensor all = at::empty({c.size()}, at::kLong);
    c.all_gather(at::full({1}, r, at::kLong), all)->wait();
    return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + c.size());
  };
  for (int C = 1; C <= W; ++C) {
    for (int T = 1; T * C <= W; ++T) {
      for (int P = 1; P * T * C <= W; ++P) {
        if (W % (T * C * P) != 0) continue;
        const int D = W / (T * C * P);
        dist::Mesh mesh(world, T, P, C);
        const std::string where = "C " + std::to_string(C) + " T " + std::to_string(T) + " P " + std::to_string(P);
        const int t = r % T, c = r / T % C, d = r / (T * C) % D, p = r / (T * C * D);
        ASSERT_EQ(mesh.cp_rank(), c) << where;
        ASSERT_EQ(mesh.dp_rank(), d) << where;
        ASSERT_EQ(mesh.pp_rank(), p) << where;
        std::vector<int64_t> replicas, cp;
        for (int i = 0; i < D; ++i) {
          for (int j = 0; j < C; ++j) replicas.push_back(((p * D + i) * C + j) * T + t);
        }
        for (int j = 0; j < C; ++j) cp.push_back(((p * D + d) * C + j) * T + t);
        EXPECT_EQ(members(mesh.replicas()), replicas) << where;
        EXPECT_EQ(members(mesh.cp()), cp) << where;
        if (C == 1) {
          EXPECT_EQ(&mesh.replicas(), &mesh.dp()) << where;
          EXPECT_FALSE(mesh.has("cp")) << where;
        }
      }
    }
  }
}

}  // namespace
}  // namespace dtrain::engine
