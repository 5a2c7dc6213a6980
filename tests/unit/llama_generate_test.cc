// Incremental decoding of the Llama model (LlamaImpl::forward_cached with a LlamaKvCache), of the
// GPT (GptImpl::forward_cached: the same contract with learned positions), and the sampling
// rules (models/sampling.h). In float64, a prompt's prefill and then one token per step
// (and a chunk of several after cached positions) give the logits the plain forward gives on the
// whole sequence, to 1e-12, for grouped-query and tied configurations, batch 2; greedy
// generation from Hugging Face LlamaForCausalLMs saved by save_pretrained gives exactly the
// tokens transformers' generate(do_sample=False) gives (tests/reference/llama_generate_reference.py).
// Sampling: greedy is the argmax, top-k keeps exactly k tokens, top-p keeps the expected nucleus,
// temperature divides the logits, a seed repeats its draws, draws follow the distribution.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/models/generate.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/models/sampling.h"
#include "dtrain/engine/train/hf_llama.h"
#include "model_cases.h"
#include "test_util.h"

namespace dtrain::engine::llama_generate_cases {
namespace {

using testing_util::error_of;
using testing_util::ScratchDir;

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

LlamaOptions small_options(int64_t kv_heads, bool tied, bool llama3) {
  LlamaOptions o;
  o.vocab = 61;
  o.d_model = 32;
  o.heads = 4;
  o.kv_heads = kv_heads;
  o.ff = 48;
  o.seq_len = 12;
  o.layers = 3;
  o.init_std = 0.3;
  o.tie_embeddings = tied;
  if (llama3) {
    o.rope_theta = 500000;
    o.rope_factor = 8;
    o.rope_original_positions = 16;
  }
  return o;
}

// A float64 model with norm weights other than 1.
std::shared_ptr<LlamaImpl> float64_model(const LlamaOptions& o, dist::Communicator& tp, uint64_t seed) {
  torch::manual_seed(seed);
  auto model = std::make_shared<LlamaImpl>(o, tp);
  model->to(at::kDouble);
  model_cases::draw_norm_weights(*model, seed + 1);
  return model;
}

// The cached logits of `tokens` fed in chunks of the given sizes, concatenated along positions.
template <class Model>
at::Tensor cached_logits(Model& model, KvCache& cache, const at::Tensor& tokens, const std::vector<int64_t>& chunks) {
  std::vector<at::Tensor> parts;
  int64_t at = 0;
  for (int64_t n : chunks) {
    parts.push_back(model.forward_cached(tokens.narrow(1, at, n), cache));
    at += n;
    EXPECT_EQ(cache.length, at);
  }
  return at::cat(parts, 1);
}

TEST(LlamaGenerate, CachedLogitsEqualTheWholeSequenceForward) {
  auto tp = testing_util::local_comm();
  struct Case {
    std::string name;
    int64_t kv_heads;
    bool tied, llama3;
  };
  for (const Case& c : {Case{"gqa_llama3", 2, false, true}, Case{"mqa_tied", 1, true, false},
                        Case{"mha_tied_llama3", 4, true, true}}) {
    SCOPED_TRACE(c.name);
    const LlamaOptions o = small_options(c.kv_heads, c.tied, c.llama3);
    auto model = float64_model(o, *tp, 3);
    auto g = at::make_generator<at::CPUGeneratorImpl>(9);
    at::Tensor tokens = at::randint(o.vocab, {2, 12}, g, at::kLong);
    at::Tensor want = model->forward(tokens).detach();
    // The cache as long as the sequence: the rotary rows are forward()'s bit for bit.
    LlamaKvCache cache = model->make_kv_cache(2, 12);
    ASSERT_EQ(cache.k.size(), 3u);
    EXPECT_EQ(cache.k[0].sizes(), (std::vector<int64_t>{2, c.kv_heads, 12, 8}));
    EXPECT_EQ(cache.k[0].scalar_type(), at::kDouble);
    // A prefill of 5, 4 single tokens, a chunk of 2 after the cached positions, one more.
    at::Tensor got = cached_logits(*model, cache, tokens, {5, 1, 1, 1, 1, 2, 1});
    EXPECT_FALSE(got.requires_grad());
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_LT(max_abs(got, want), 1e-12) << "max |diff| " << max_abs(got, want);
    // Cleared, it starts over: the same logits fed one token at a time from position 0.
    cache.clear();
    at::Tensor again = cached_logits(*model, cache, tokens, std::vector<int64_t>(12, 1));
    EXPECT_LT(max_abs(again, want), 1e-12) << "max |diff| " << max_abs(again, want);
    std::cout << "[ generate ] " << c.name << ": cached vs whole-sequence logits max |diff| " << max_abs(got, want)
              << " (chunks), " << max_abs(again, want) << " (one token a step)\n";
  }
}

TEST(LlamaGenerate, ErrorsNameTheProblem) {
  auto tp = testing_util::local_comm();
  const LlamaOptions o = small_options(2, false, false);
  auto model = float64_model(o, *tp, 4);
  at::Tensor tokens = at::randint(o.vocab, {2, 4}, at::kLong);
  auto cache = model->make_kv_cache(2, 6);
  model->forward_cached(tokens, cache);
  EXPECT_NE(error_of([&] { model->forward_cached(tokens, cache); }).find("4 new tokens after 4 cached positions need "
                                                                         "8 positions; the cache holds 6"),
            std::string::npos);
  EXPECT_EQ(cache.length, 4) << "a refused call leaves the cache as it was";
  auto wide = model->make_kv_cache(3, 6);
  EXPECT_NE(error_of([&] { model->forward_cached(tokens, wide); }).find("2 rows of tokens, the cache holds 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { model->forward_cached(tokens.to(at::kFloat), wide); }).find("tokens must be integer ids"),
            std::string::npos);
  auto other = float64_model(small_options(4, false, false), *tp, 5)->make_kv_cache(2, 6);
  EXPECT_NE(error_of([&] { model->forward_cached(tokens, other); }).find("the cache was not made for this model"),
            std::string::npos);
  LlamaOptions sp = o;
  sp.sequence_parallel = true;
  LlamaImpl split(sp, *tp);
  auto sp_cache = split.make_kv_cache(2, 6);
  EXPECT_NE(error_of([&] { split.forward_cached(tokens, sp_cache); }).find("build the model without sequence_parallel"),
            std::string::npos);
  EXPECT_NE(error_of([&] { model->make_kv_cache(0, 6); }).find("must be positive"), std::string::npos);
}

TEST(GptGenerate, CachedLogitsEqualTheWholeSequenceForward) {
  auto tp = testing_util::local_comm();
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const GptOptions o = model_cases::split_gpt_options(12, tied);  // 8 heads of 8, 2 layers
    torch::manual_seed(3);
    GptImpl model(o, *tp);
    model.to(at::kDouble);
    model.eval();
    model_cases::draw_norm_weights(model, 4);  // layer norms' weights and biases
    auto g = at::make_generator<at::CPUGeneratorImpl>(9);
    at::Tensor tokens = at::randint(o.vocab, {2, 12}, g, at::kLong);
    at::Tensor want;
    {
      at::NoGradGuard no_grad;
      want = model.forward(tokens);
    }
    KvCache cache = model.make_kv_cache(2, 12);
    EXPECT_EQ(cache.k[0].sizes(), (std::vector<int64_t>{2, 8, 12, 8}));
    at::Tensor got = cached_logits(model, cache, tokens, {5, 1, 1, 1, 1, 2, 1});
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_LT(max_abs(got, want), 1e-12) << "max |diff| " << max_abs(got, want);
    cache.clear();
    at::Tensor again = cached_logits(model, cache, tokens, std::vector<int64_t>(12, 1));
    EXPECT_LT(max_abs(again, want), 1e-12) << "max |diff| " << max_abs(again, want);
    std::cout << "[ generate ] gpt " << (tied ? "tied" : "untied") << ": cached vs whole-sequence logits max |diff| "
              << max_abs(got, want) << " (chunks), " << max_abs(again, want) << " (one token a step)\n";
    EXPECT_NE(error_of([&] { model.make_kv_cache(2, 13); }).find("max_len 13 is more positions than the GPT's 12"),
              std::string::npos);
    KvCache short_cache = model.make_kv_cache(2, 4);
    EXPECT_NE(error_of([&] { model.forward_cached(tokens.narrow(1, 0, 5), short_cache); })
                  .find("5 new tokens after 0 cached positions need 5 positions; the cache holds 4"),
              std::string::npos);
  }
}

// Prompts of 7 and 4 tokens in one left-padded batch (3 pads of an arbitrary id), then 3 new
// tokens a step: each row's logits at its real positions equal its own sequence's whole forward
// (no padding), and nothing is NaN (the pads' own positions included).
template <class Model>
void check_left_padding(Model& model, int64_t vocab, const std::string& name) {
  SCOPED_TRACE(name);
  auto g = at::make_generator<at::CPUGeneratorImpl>(21);
  const at::Tensor a = at::randint(vocab, {1, 10}, g, at::kLong);       // row 0: 7 prompt + 3 new tokens
  const at::Tensor b = at::randint(vocab, {1, 7}, g, at::kLong);        // row 1: 4 prompt + 3 new tokens
  const at::Tensor pads = at::full({1, 3}, vocab - 1, at::kLong);       // any id: never attended
  const at::Tensor batch = at::cat({a, at::cat({pads, b}, 1)}, 0);      // [2, 10] left-padded
  KvCache cache = model.make_kv_cache(2, 10);
  cache.left_pad = at::tensor(std::vector<int64_t>{0, 3}, at::kLong);
  at::Tensor got = cached_logits(model, cache, batch, {7, 1, 1, 1});     // [2, 10, local vocab]
  EXPECT_FALSE(at::isnan(got).any().item<bool>()) << "a pad position's logits are NaN";
  at::Tensor want_a, want_b;
  {
    at::NoGradGuard no_grad;
    want_a = model.forward(a);
    want_b = model.forward(b);
  }
  const double da = max_abs(got.narrow(0, 0, 1), want_a), db = max_abs(got.narrow(0, 1, 1).narrow(1, 3, 7), want_b);
  EXPECT_LT(da, 1e-12) << "the unpadded row";
  EXPECT_LT(db, 1e-12) << "the padded row against its prompt alone";
  std::cout << "[ generate ] " << name << " left-padded batch: max |diff| " << da << " (full row), " << db
            << " (padded row vs its sequence alone)\n";
  cache.clear();
  EXPECT_FALSE(cache.left_pad.defined()) << "clear() drops the padding";
  cache.left_pad = at::tensor(std::vector<int64_t>{0}, at::kLong);
  EXPECT_NE(error_of([&] { model.forward_cached(batch.narrow(1, 0, 2), cache); }).find("cache.left_pad must be int64 [2]"),
            std::string::npos);
}

TEST(LlamaGenerate, LeftPaddedRowsEqualTheirPromptsAlone) {
  auto tp = testing_util::local_comm();
  const LlamaOptions o = small_options(2, false, true);
  auto llama = float64_model(o, *tp, 8);
  check_left_padding(*llama, o.vocab, "llama gqa_llama3");
  const GptOptions go = model_cases::split_gpt_options(12, true);
  torch::manual_seed(9);
  GptImpl gpt(go, *tp);
  gpt.to(at::kDouble);
  gpt.eval();
  model_cases::draw_norm_weights(gpt, 10);
  check_left_padding(gpt, go.vocab, "gpt tied");
}

// The greedy continuation of `prompt` [B, P]: [B, n] new tokens.
at::Tensor greedy(LlamaImpl& model, const at::Tensor& prompt, int64_t n) {
  LlamaKvCache cache = model.make_kv_cache(prompt.size(0), prompt.size(1) + n);
  SamplingOptions s;
  s.temperature = 0;
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(0);
  at::Tensor logits = model.forward_cached(prompt, cache);
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(sample_next_tokens(logits.select(1, -1).narrow(1, 0, model.options.vocab), s, g));
    if (i + 1 < n) logits = model.forward_cached(out.back().unsqueeze(1), cache);
  }
  return at::stack(out, 1);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(LlamaGenerate, GreedyTokensEqualTransformersGenerate) {
  ScratchDir scratch("llama_generate", true);
  const std::vector<std::string> cases = {"gqa_llama3", "mha_tied"};
  std::vector<std::string> args = {scratch.str()};
  args.insert(args.end(), cases.begin(), cases.end());
  const std::string out = testing_util::run_python("tests/reference/llama_generate_reference.py", args);
  ASSERT_FALSE(out.empty());
  auto tp = testing_util::local_comm();
  for (const std::string& name : cases) {
    SCOPED_TRACE(name);
    const std::string dir = scratch / name;
    const LlamaOptions o = llama_options_from_hf_config(read_file(dir + "/config.json"));
    LlamaImpl model(o, *tp);
    model.to(at::kDouble);
    EXPECT_GT(load_hf_weights(dir, model, *tp, llama_hf_names()), 0);
    const nlohmann::json ref = nlohmann::json::parse(read_file(dir + "/generate.json"));
    const auto prompt_rows = ref.at("prompt").get<std::vector<std::vector<int64_t>>>();
    const auto want_rows = ref.at("new_tokens").get<std::vector<std::vector<int64_t>>>();
    at::Tensor prompt = at::empty({2, static_cast<int64_t>(prompt_rows[0].size())}, at::kLong);
    for (int64_t r = 0; r < 2; ++r) {
      for (size_t i = 0; i < prompt_rows[r].size(); ++i) prompt[r][i] = prompt_rows[r][i];
    }
    at::Tensor got = greedy(model, prompt, static_cast<int64_t>(want_rows[0].size()));
    for (int64_t r = 0; r < 2; ++r) {
      std::vector<int64_t> row(got[r].data_ptr<int64_t>(), got[r].data_ptr<int64_t>() + got.size(1));
      EXPECT_EQ(row, want_rows[r]) << "row " << r;
    }
    std::cout << "[ generate ] " << name << ": " << got.size(1) << " greedy tokens x 2 rows equal transformers "
              << nlohmann::json::parse(out).at("transformers").get<std::string>() << "'s\n";
  }
}

// The library's generate() (generate.h) against an independent loop: the argmax of the whole
// sequence's forward, step by step, row by row. Two prompts of unequal length in one call (left
// padding); eos chosen as a token row 0 draws at its third step, so row 0 stops there and row 1
// goes on; the recomputing path gives the same tokens for prompts of one length.
TEST(Generate, LibraryGreedyEqualsTheWholeSequenceArgmax) {
  auto tp = testing_util::local_comm();
  const LlamaOptions o = small_options(2, false, true);
  auto model = float64_model(o, *tp, 12);
  model->eval();
  const auto argmax_loop = [&](std::vector<int64_t> seq, int64_t n, int64_t eos) {
    std::vector<int64_t> out;
    at::NoGradGuard no_grad;
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor logits = model->forward(at::tensor(seq, at::kLong).unsqueeze(0));
      const int64_t t = logits[0][-1].narrow(0, 0, o.vocab).argmax().item<int64_t>();
      out.push_back(t);
      seq.push_back(t);
      if (t == eos) break;
    }
    return out;
  };
  const std::vector<std::vector<int64_t>> prompts = {{3, 9, 27, 5, 44}, {7, 13}};
  GenerateOptions g;
  g.max_new_tokens = 6;
  g.sampling.temperature = 0;
  const std::vector<int64_t> free0 = argmax_loop(prompts[0], 6, -1);
  g.eos = free0[2];
  const Generated got = generate(decoder_of(model, o.vocab), prompts, g, *tp, at::kCPU);
  ASSERT_EQ(got.rows.size(), 2u);
  EXPECT_EQ(got.rows[0], argmax_loop(prompts[0], 6, g.eos));
  EXPECT_EQ(got.rows[1], argmax_loop(prompts[1], 6, g.eos));
  EXPECT_EQ(got.rows[0].back(), g.eos);
  EXPECT_LE(got.rows[0].size(), 3u) << "row 0 ends at its eos";
  GenerateOptions plain = g;
  plain.eos = -1;
  plain.use_cache = false;
  const Generated again = generate(decoder_of(model, o.vocab), {prompts[0], prompts[0]}, plain, *tp, at::kCPU);
  EXPECT_EQ(again.rows[0], free0);
  EXPECT_EQ(again.rows[1], free0);
  EXPECT_NE(error_of([&] { generate(decoder_of(model, o.vocab), prompts, plain, *tp, at::kCPU); })
                .find("use_cache = false recomputes without padding"),
            std::string::npos);
  EXPECT_NE(error_of([&] { generate(decoder_of(model, o.vocab), {{1, o.vocab}}, g, *tp, at::kCPU); })
                .find("holds the id 61, outside the vocabulary of 61"),
            std::string::npos);
  EXPECT_NE(error_of([&] { generate(decoder_of(model, o.vocab), {{}}, g, *tp, at::kCPU); }).find("prompt 1 is empty"),
            std::string::npos);
}

// ---- sampling ----------------------------------------------------------------------------

at::Tensor logits_of(const std::vector<double>& probabilities) {
  return at::log(at::tensor(probabilities, at::kDouble)).unsqueeze(0);
}

TEST(Sampling, GreedyIsTheArgmax) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1);
  at::Tensor logits = at::randn({5, 40}, g, at::kFloat);
  SamplingOptions s;
  s.temperature = 0;
  s.top_k = 3;  // no effect on greedy
  EXPECT_TRUE(at::equal(sample_next_tokens(logits, s, g), logits.argmax(1)));
  at::Tensor p = sampling_probabilities(logits, s);
  EXPECT_TRUE(at::equal(p.argmax(1), logits.argmax(1)));
  EXPECT_TRUE(at::equal(p.sum(1), at::ones({5})));
  // Equal maxima: the lower id, as torch's argmax.
  at::Tensor tie = at::tensor({0.5, 2.0, 1.0, 2.0}).unsqueeze(0);
  EXPECT_EQ(sample_next_tokens(tie, s, g).item<int64_t>(), 1);
  // bfloat16 logits work too.
  EXPECT_TRUE(at::equal(sample_next_tokens(logits.to(at::kBFloat16), s, g), logits.to(at::kBFloat16).argmax(1)));
}

TEST(Sampling, TemperatureDividesTheLogits) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(2);
  at::Tensor logits = at::randn({3, 17}, g, at::kDouble);
  for (double t : {0.5, 1.0, 2.5}) {
    SamplingOptions s;
    s.temperature = t;
    EXPECT_LT(max_abs(sampling_probabilities(logits, s), at::softmax(logits / t, 1)), 1e-15) << t;
  }
}

TEST(Sampling, TopKKeepsExactlyK) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor logits = at::randn({4, 50}, g, at::kFloat);
  for (int64_t k : {1, 5, 49, 50, 80}) {
    SamplingOptions s;
    s.top_k = k;
    at::Tensor p = sampling_probabilities(logits, s);
    const int64_t kept = std::min<int64_t>(k, 50);
    EXPECT_TRUE(at::equal((p > 0).sum(1), at::full({4}, kept, at::kLong))) << k;
    // The kept ones are the k largest, in the softmax's proportions.
    at::Tensor top = std::get<1>(logits.topk(kept, 1));
    EXPECT_TRUE(at::equal(p.gather(1, top) > 0, at::ones({4, kept}, at::kBool))) << k;
    EXPECT_LT(max_abs(p.gather(1, top), at::softmax(logits.gather(1, top), 1)), 1e-6) << k;
    for (int i = 0; i < 20; ++i) {
      at::Tensor t = sample_next_tokens(logits, s, g);
      EXPECT_TRUE((p.gather(1, t.unsqueeze(1)) > 0).all().item<bool>()) << k;
    }
  }
  // Ties at the k-th place: still exactly k.
  SamplingOptions s;
  s.top_k = 2;
  EXPECT_EQ((sampling_probabilities(at::zeros({1, 6}), s) > 0).sum().item<int64_t>(), 2);
}

TEST(Sampling, TopPKeepsTheSmallestSetReachingP) {
  // Probabilities 0.4, 0.3, 0.2, 0.1 (shuffled): the nucleus of p keeps the most likely tokens
  // until their mass reaches p.
  at::Tensor logits = logits_of({0.2, 0.4, 0.1, 0.3});
  const std::vector<std::pair<double, std::vector<bool>>> cases = {
      {0.05, {false, true, false, false}},  // at least one token
      {0.35, {false, true, false, false}},  {0.45, {false, true, false, true}},
      {0.65, {false, true, false, true}},   {0.75, {true, true, false, true}},
      {0.95, {true, true, true, true}},     {1.0, {true, true, true, true}}};
  for (const auto& [p, want] : cases) {
    SamplingOptions s;
    s.top_p = p;
    at::Tensor probs = sampling_probabilities(logits, s)[0];
    double kept_mass = 0;
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(probs[i].item<double>() > 0, want[i]) << "top_p " << p << " token " << i;
      if (want[i]) kept_mass += at::exp(logits[0][i]).item<double>();
    }
    for (int i = 0; i < 4; ++i) {  // renormalized over the kept tokens
      if (want[i]) EXPECT_NEAR(probs[i].item<double>(), at::exp(logits[0][i]).item<double>() / kept_mass, 1e-12);
    }
  }
  // After top-k, the nucleus of the renormalized top 2 (0.4/0.7 = 0.57, 0.3/0.7 = 0.43): 0.55
  // keeps the first only, 0.6 both (of the whole distribution, 0.6 would keep 3 tokens).
  SamplingOptions s;
  s.top_k = 2;
  s.top_p = 0.55;
  EXPECT_EQ((sampling_probabilities(logits, s)[0] > 0).sum().item<int64_t>(), 1);
  s.top_p = 0.6;
  at::Tensor probs = sampling_probabilities(logits, s)[0];
  EXPECT_EQ((probs > 0).sum().item<int64_t>(), 2);
  EXPECT_NEAR(probs[1].item<double>(), 0.4 / 0.7, 1e-12);
}

TEST(Sampling, ASeedRepeatsItsDraws) {
  auto data = at::make_generator<at::CPUGeneratorImpl>(4);
  at::Tensor logits = at::randn({3, 100}, data, at::kFloat);
  SamplingOptions s;
  s.temperature = 1.3;
  s.top_k = 40;
  s.top_p = 0.9;
  auto draws = [&](uint64_t seed) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<at::Tensor> out;
    for (int i = 0; i < 30; ++i) out.push_back(sample_next_tokens(logits, s, g));
    return at::stack(out);
  };
  at::Tensor a = draws(7);
  EXPECT_TRUE(at::equal(a, draws(7)));
  EXPECT_FALSE(at::equal(a, draws(8)));
  EXPECT_EQ(a.scalar_type(), at::kLong);
  EXPECT_TRUE(a.device().is_cpu());
}

TEST(Sampling, DrawsFollowTheDistribution) {
  at::Tensor logits = logits_of({0.5, 0.25, 0.15, 0.1}).expand({4000, 4}).contiguous();
  SamplingOptions s;
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor counts = at::bincount(sample_next_tokens(logits, s, g), {}, 4).to(at::kDouble) / 4000;
  const std::vector<double> want = {0.5, 0.25, 0.15, 0.1};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(counts[i].item<double>(), want[i], 0.03) << i;  // > 3.5 sigma
}

TEST(Sampling, BadOptionsAreNamed) {
  at::Tensor logits = at::zeros({1, 4});
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(1);
  auto error = [&](SamplingOptions s) { return error_of([&] { sample_next_tokens(logits, s, g); }); };
  SamplingOptions s;
  s.temperature = -1;
  EXPECT_NE(error(s).find("temperature must be >= 0"), std::string::npos);
  s = {};
  s.top_k = -2;
  EXPECT_NE(error(s).find("top_k must be >= 0"), std::string::npos);
  s = {};
  s.top_p = 0;
  EXPECT_NE(error(s).find("top_p must be in (0, 1]"), std::string::npos);
  s.top_p = 1.5;
  EXPECT_NE(error(s).find("top_p must be in (0, 1]"), std::string::npos);
  EXPECT_NE(error_of([&] { sample_next_tokens(at::zeros({4}), SamplingOptions{}, g); }).find("logits must be"),
            std::string::npos);
  EXPECT_NE(error_of([&] { sample_next_tokens(at::full({1, 3}, NAN), SamplingOptions{}, g); })
                .find("gives no distribution"),
            std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine::llama_generate_cases
