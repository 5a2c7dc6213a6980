// Sequence parallelism: the primitives against closed forms (every rank's input is known to
// every rank through its seed), and a small GPT-style model run sequence-parallel against the
// same weights in the plain (tensor-parallel size 1) model, in float64, for T = 2 and 4: loss
// and every parameter gradient, with activation checkpointing and gradient accumulation.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::rel_error;
using testing_util::same_everywhere;
using testing_util::world_comm;

constexpr double kSequenceTol = 1e-12;

// Tensors of rank k of the group are same_everywhere(shape, base + k): every rank can build them all.
std::vector<at::Tensor> per_rank(std::vector<int64_t> shape, uint64_t base, int T) {
  std::vector<at::Tensor> out;
  for (int k = 0; k < T; ++k) out.push_back(same_everywhere(shape, base + k));
  return out;
}

at::Tensor sum_of(const std::vector<at::Tensor>& ts) {
  at::Tensor s = at::zeros_like(ts[0]);
  for (const at::Tensor& t : ts) s = s + t;
  return s;
}

TEST(SequenceParallelPrimitives, GatherReduceScatterAndScatterMatchClosedForms) {
  if (world_comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    auto& tp = mesh.tp();
    const int r = tp.rank();
    for (int64_t dim : {0, 1, -1}) {
      const int64_t d = dim < 0 ? dim + 3 : dim;
      std::vector<int64_t> local = {2, 3, 4};
      std::vector<int64_t> full = local;
      full[d] *= T;
      // gather: concatenation in rank order; backward: this rank's chunk of the summed gradients.
      auto xs = per_rank(local, 100, T);
      auto probes = per_rank(full, 200, T);
      at::Tensor x = xs[r].clone().requires_grad_(true);
      at::Tensor y = gather_from_sequence_parallel(x, tp, dim);
      EXPECT_LT(rel_error(y, at::cat(xs, d)), kSequenceTol) << "gather T=" << T << " dim=" << dim;
      (y * probes[r]).sum().backward();
      EXPECT_LT(rel_error(x.grad(), sum_of(probes).chunk(T, d)[r]), kSequenceTol)
          << "gather backward T=" << T;
      // reduce-scatter: this rank's chunk of the sum; backward: the gradients concatenated.
      auto zs = per_rank(full, 300, T);
      auto qs = per_rank(local, 400, T);
      at::Tensor z = zs[r].clone().requires_grad_(true);
      at::Tensor w = reduce_scatter_to_sequence_parallel(z, tp, dim);
      EXPECT_LT(rel_error(w, sum_of(zs).chunk(T, d)[r]), kSequenceTol)
          << "reduce-scatter T=" << T << " dim=" << dim;
      (w * qs[r]).sum().backward();
      EXPECT_LT(rel_error(z.grad(), at::cat(qs, d)), kSequenceTol) << "reduce-scatter backward T=" << T;
      // scatter of a tensor identical everywhere: the chunk; backward: the gradients concatenated.
      at::Tensor s = same_everywhere(full, 500).requires_grad_(true);
      at::Tensor c = scatter_to_sequence_parallel(s, tp, dim);
      EXPECT_TRUE(at::equal(c, s.detach().chunk(T, d)[r]));
      (c * qs[r]).sum().backward();
      EXPECT_LT(rel_error(s.grad(), at::cat(qs, d)), kSequenceTol) << "scatter backward T=" << T;
    }
  }
  // A group of one: the identity, no communication.
  dist::Mesh alone(world_comm(), 1);
  at::Tensor x = same_everywhere({2, 3}, 7);
  EXPECT_TRUE(gather_from_sequence_parallel(x, alone.tp()).is_same(x));
  EXPECT_TRUE(reduce_scatter_to_sequence_parallel(x, alone.tp()).is_same(x));
}

TEST(SequenceParallelPrimitives, ASequenceThatDoesNotSplitIsRefusedWithTheNumbers) {
  if (world_comm().size() < 2) GTEST_SKIP();
  dist::Mesh mesh(world_comm(), 2);
  try {
    reduce_scatter_to_sequence_parallel(same_everywhere({2, 5, 3}, 1), mesh.tp());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot split a sequence of 5"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("over 2 tensor-parallel ranks"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(scatter_to_sequence_parallel(same_everywhere({3, 4}, 1), mesh.tp(), 0), Error);
  EXPECT_THROW(gather_from_sequence_parallel(same_everywhere({3, 4}, 1), mesh.tp(), 2),
               Error);  // no such dim
  VocabParallelEmbedding emb(10, 4, mesh.tp(), SequenceParallel::kOn);
  try {
    emb->forward(at::zeros({2, 7}, at::kLong));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a sequence of 7 tokens does not split over 2"),
              std::string::npos)
        << e.what();
  }
  // The communicator is still in step on every rank after the refusals.
  at::Tensor one = at::ones({1});
  mesh.tp().all_reduce(one)->wait();
  EXPECT_EQ(one.item<float>(), 2.0f);
}

constexpr int64_t kVocab = 13, kD = 16, kHeads = 4, kFf = 32, kSeq = 8, kBatch = 2;

// A pre-norm GPT block as in examples/gpt_model (its own code here; tests link only the engine).
struct TinyBlockImpl : torch::nn::Module {
  TinyBlockImpl(dist::Communicator& c, bool sp) : tp(&c), sp(sp) {
    auto mode = sp ? SequenceParallel::kOn : SequenceParallel::kOff;
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
    attn = register_module("attn", ParallelSelfAttention(kD, kHeads, true, c, mode));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
    mlp = register_module("mlp", ParallelMlp(kD, kFf, c, mode));
  }
  at::Tensor norm(torch::nn::LayerNorm& ln, const at::Tensor& x) {
    return sp ? sequence_parallel_layer_norm(ln, x, *tp) : ln->forward(x);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attn->forward(norm(ln1, x));
    return h + mlp->forward(norm(ln2, h));
  }
  dist::Communicator* tp;
  bool sp;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ParallelSelfAttention attn{nullptr};
  ParallelMlp mlp{nullptr};
};
TORCH_MODULE(TinyBlock);

struct TinyGpt : torch::nn::Module {
  TinyGpt(dist::Communicator& c, bool sp, bool ckpt) : tp(&c), sp(sp), ckpt(ckpt) {
    wte = register_module(
        "wte",
        VocabParallelEmbedding(kVocab, kD, c, sp ? SequenceParallel::kOn : SequenceParallel::kOff));
    wpe = register_parameter("wpe", at::randn({kSeq, kD}));
    for (int i = 0; i < 2; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), TinyBlock(c, sp)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
    ParallelLinearOptions o(kD, kVocab);
    o.bias = false;
    o.pad_output = true;
    o.sequence_parallel = sp;
    head = register_module("head", ColumnParallelLinear(o, c));
  }
  at::Tensor embed(const at::Tensor& tokens) {
    return wte->forward(tokens) + (sp ? scatter_to_sequence_parallel(wpe, *tp, 0) : wpe);
  }
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets) {
    at::Tensor x = embed(tokens);
    for (TinyBlock& b : blocks) {
      TinyBlockImpl* block = b.get();
      x = ckpt ? checkpoint([block](const at::Tensor& in) { return block->forward(in); }, x,
                            block->parameters())
               : block->forward(x);
    }
    at::Tensor logits =
        head->forward(sp ? sequence_parallel_layer_norm(ln_f, x, *tp) : ln_f->forward(x));
    const int64_t local = logits.size(-1);
    return vocab_parallel_cross_entropy(logits.reshape({-1, local}), targets.reshape({-1}),
                                        local * tp->rank(), kVocab, *tp);
  }
  dist::Communicator* tp;
  bool sp, ckpt;
  VocabParallelEmbedding wte{nullptr};
  at::Tensor wpe;
  std::vector<TinyBlock> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  ColumnParallelLinear head{nullptr};
};

at::Tensor tokens(uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(kVocab, {kBatch, kSeq + 1}, g, at::kLong);
}

TEST(SequenceParallelModel, LossAndEveryGradientEqualThePlainModel) {
  if (world_comm().size() < 2) GTEST_SKIP();
  dist::Mesh plain_mesh(world_comm(), 1);
  // The plain model with random values in every parameter (layer norms included).
  TinyGpt ref(plain_mesh.tp(), /*sp=*/false, /*ckpt=*/false);
  ref.to(at::kDouble);
  {
    torch::NoGradGuard ng;
    uint64_t seed = 1000;
    for (auto& item : ref.named_parameters())
      item.value().copy_(same_everywhere(item.value().sizes().vec(), seed++));
  }
  // Two micro-batches accumulated.
  const at::Tensor a = tokens(1), b = tokens(2);
  auto run = [&](TinyGpt& m) {
    at::Tensor la = m.loss(a.narrow(1, 0, kSeq), a.narrow(1, 1, kSeq));
    la.backward();
    at::Tensor lb = m.loss(b.narrow(1, 0, kSeq), b.narrow(1, 1, kSeq));
    lb.backward();
    return at::stack({la.detach(), lb.detach()});
  };
  const at::Tensor ref_loss = run(ref);
  std::map<std::string, at::Tensor> ref_grads;
  for (auto& item : ref.named_parameters()) ref_grads[item.key()] = item.value().grad();
  const auto full_state = gather_full_state(ref, plain_mesh.tp());
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    auto& tp = mesh.tp();
    for (bool ckpt : {false, true}) {
      TinyGpt split(tp, /*sp=*/true, ckpt);
      split.to(at::kDouble);
      load_full_state(split, full_state, tp);
      {
        torch::NoGradGuard ng;
        EXPECT_EQ(split.embed(a.narrow(1, 0, kSeq)).size(1), kSeq / T)
            << "activations are not split";
      }
      at::Tensor loss = run(split);
      EXPECT_LT(rel_error(loss, ref_loss), kSequenceTol) << "T=" << T << " ckpt=" << ckpt;
      auto specs = collect_shard_specs(split);
      for (auto& item : split.named_parameters()) {
        const at::Tensor& g = item.value().grad();
        ASSERT_TRUE(g.defined()) << item.key();
        auto spec = specs.find(item.key());
        at::Tensor full = spec == specs.end() ? g : gather_full_tensor(g, spec->second, tp);
        EXPECT_LT(rel_error(full, ref_grads.at(item.key())), kSequenceTol)
            << item.key() << " T=" << T << " ckpt=" << ckpt << " rank " << tp.rank();
      }
    }
  }
}

}  // namespace
}  // namespace dtrain::engine
