// TokenShardDataset over shards written by tests/reference/token_shards_reference.py (numpy,
// as llm.c's write_datafile, nanoGPT's tofile and Megatron's indexed-dataset builder write
// them): every window of every format against the tokens the script reports, directories and
// glob patterns, the DataLoader's rank sharding over windows, and each broken file's error.
#include "dtrain/engine/data/token_shards.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/data/data.h"
#include "test_util.h"

namespace dtrain::engine::token_shards_test {
namespace {

using Tokens = std::vector<int64_t>;

// Fails the test unless fn throws a dtrain::Error whose message holds every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  const std::string msg = testing_util::error_of(fn);
  for (const std::string& p : parts) {
    EXPECT_NE(msg.find(p), std::string::npos) << "expected '" << p << "' in the error: " << msg;
  }
}

TokenShardOptions opts(std::vector<std::string> paths, int64_t seq_len,
                       TokenFormat format = TokenFormat::kAuto) {
  TokenShardOptions o;
  o.paths = std::move(paths);
  o.seq_len = seq_len;
  o.format = format;
  return o;
}

Tokens row(const at::Tensor& batch, int64_t r) {
  at::Tensor t = batch[r].contiguous();
  return Tokens(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

class TokenShardTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing_util::ScratchDir("token_shards", true);
    tokens_ = new std::map<std::string, Tokens>;
    const std::string out =
        testing_util::run_python("tests/reference/token_shards_reference.py", {dir_->str()});
    if (out.empty()) return;
    const nlohmann::json reference = nlohmann::json::parse(out);
    for (const auto& [rel, list] : reference.at("tokens").items())
      (*tokens_)[rel] = list.get<Tokens>();
  }
  static void TearDownTestSuite() {
    delete tokens_;
    delete dir_;
  }
  static std::string path(const std::string& rel) { return (*dir_) / rel; }

  // Checks the shards (in order) and every window of `data` against the reference tokens:
  // window k of a shard is its tokens [k * S, k * S + S + 1), samples numbered shard by shard.
  void expect_windows(const TokenShardDataset& data, const std::vector<std::string>& rels) {
    ASSERT_FALSE(tokens_->empty()) << "the reference script wrote nothing";
    const int64_t S = data.seq_len();
    ASSERT_EQ(data.shards().size(), rels.size());
    std::vector<Tokens> expected;
    int64_t total = 0;
    for (size_t s = 0; s < rels.size(); ++s) {
      const Tokens& t = tokens_->at(rels[s]);
      EXPECT_EQ(data.shards()[s].path, path(rels[s]));
      EXPECT_EQ(data.shards()[s].tokens, static_cast<int64_t>(t.size())) << rels[s];
      total += static_cast<int64_t>(t.size());
      int64_t windows = 0;
      for (size_t k = 0; k * S + S + 1 <= t.size(); ++k, ++windows) {
        expected.emplace_back(t.begin() + static_cast<int64_t>(k * S),
                              t.begin() + static_cast<int64_t>(k * S + S + 1));
      }
      EXPECT_EQ(data.shards()[s].windows, windows) << rels[s];
    }
    EXPECT_EQ(data.total_tokens(), total);
    ASSERT_EQ(data.size(), static_cast<int64_t>(expected.size()));
    std::vector<int64_t> all;
    for (int64_t i = data.size() - 1; i >= 0; --i) all.push_back(i);  // out of order on purpose
    const std::vector<at::Tensor> batch = data.get_batch(all);
    ASSERT_EQ(batch.size(), 1u);
    EXPECT_EQ(batch[0].scalar_type(), at::kLong);
    ASSERT_EQ(batch[0].sizes(), (std::vector<int64_t>{data.size(), S + 1}));
    for (size_t r = 0; r < all.size(); ++r) {
      EXPECT_EQ(row(batch[0], static_cast<int64_t>(r)), expected[static_cast<size_t>(all[r])])
          << "window " << all[r];
    }
  }

  static testing_util::ScratchDir* dir_;
  static std::map<std::string, Tokens>* tokens_;
};

testing_util::ScratchDir* TokenShardTest::dir_ = nullptr;
std::map<std::string, Tokens>* TokenShardTest::tokens_ = nullptr;

TEST_F(TokenShardTest, LlmcGpt2DirectoryGivesEveryWindow) {
  // notes.txt is ignored; shard_002 (9 tokens) is too short for a window of 17 and gives none.
  TokenShardOptions o = opts({path("gpt2")}, 16);
  o.vocab = 50257;
  TokenShardDataset data(o);
  expect_windows(data, {"gpt2/shard_000.bin", "gpt2/shard_001.bin", "gpt2/shard_002.bin"});
  EXPECT_EQ(data.size(), 300 / 16 + 66 / 16);
  EXPECT_EQ(data.shards()[0].format, TokenFormat::kLlmc);
  EXPECT_EQ(data.shards()[0].dtype, "uint16");
  const std::string line = data.describe();
  for (const char* part : {"3 files (shard_000.bin, shard_001.bin, shard_002.bin)", "llmc uint16",
                           "377 tokens", "22 windows of seq_len 16", "1 shard(s) too short"}) {
    EXPECT_NE(line.find(part), std::string::npos) << part << " in " << line;
  }
  // Windows of seq_len + 1 tokens overlap by one token.
  const at::Tensor two = data.get_batch({0, 1})[0];
  EXPECT_EQ(two[0][16].item<int64_t>(), two[1][0].item<int64_t>());
  EXPECT_EQ(data.get_batch({})[0].sizes(), (std::vector<int64_t>{0, 17}));
  expect_error([&] { data.get_batch({data.size()}); }, {"index 22", "[0, 22)"});
}

TEST_F(TokenShardTest, LlmcLlama3GlobAndSingleFile) {
  TokenShardOptions o = opts({path("llama3/train_*.bin")}, 32, TokenFormat::kLlmc);
  o.vocab = 128256;
  TokenShardDataset data(o);  // val_000.bin is not matched
  expect_windows(data, {"llama3/train_000.bin", "llama3/train_001.bin"});
  EXPECT_EQ(data.shards()[1].dtype, "uint32");
  EXPECT_EQ(data.get_batch({0})[0][0][0].item<int64_t>(), 128255);
  TokenShardDataset one(opts({path("llama3/val_000.bin")}, 7));
  expect_windows(one, {"llama3/val_000.bin"});
}

TEST_F(TokenShardTest, NanoGptRawFiles) {
  // The directory's meta.pkl is ignored; val.bin sorts after train.bin.
  TokenShardDataset data(opts({path("nanogpt16")}, 24, TokenFormat::kRaw));
  expect_windows(data, {"nanogpt16/train.bin", "nanogpt16/val.bin"});
  TokenShardOptions o = opts({path("nanogpt32/train.bin")}, 10, TokenFormat::kRaw);
  o.raw_token_bytes = 4;
  TokenShardDataset wide(o);
  expect_windows(wide, {"nanogpt32/train.bin"});
  EXPECT_EQ(wide.shards()[0].dtype, "uint32");
  // Headerless files are never guessed.
  expect_error([&] { TokenShardDataset guess(opts({path("nanogpt16/train.bin")}, 24)); },
               {"nanogpt16/train.bin", "20240520", "20240801", "format raw"});
}

TEST_F(TokenShardTest, MegatronPrefixesDirectoryAndGlob) {
  const std::vector<std::string> all = {"megatron/corpus_a.bin", "megatron/corpus_b.bin",
                                        "megatron/corpus_c.bin", "megatron/corpus_d.bin",
                                        "megatron/corpus_e.bin"};
  TokenShardDataset dir(opts({path("megatron")}, 9));  // each .bin/.idx pair once
  expect_windows(dir, all);
  EXPECT_EQ(dir.shards()[0].format, TokenFormat::kMegatron);
  EXPECT_EQ(dir.shards()[0].documents, 4);
  std::vector<std::string> dtypes;
  for (const TokenShardInfo& s : dir.shards()) dtypes.push_back(s.dtype);
  EXPECT_EQ(dtypes, (std::vector<std::string>{"uint16", "int32", "int64", "uint8", "int16"}));
  TokenShardDataset glob(opts({path("megatron/corpus_*")}, 9, TokenFormat::kMegatron));
  expect_windows(glob, all);
  // A prefix, a .idx and a .bin name the same pair; entries keep the order given.
  TokenShardDataset named(opts(
      {path("megatron/corpus_c"), path("megatron/corpus_a.idx"), path("megatron/corpus_b.bin")},
      5));
  expect_windows(named,
                 {"megatron/corpus_c.bin", "megatron/corpus_a.bin", "megatron/corpus_b.bin"});
}

TEST_F(TokenShardTest, DataLoaderRanksSeeWhatOneRankSeesWithTheGlobalBatch) {
  auto data = std::make_shared<TokenShardDataset>(opts({path("gpt2")}, 16));  // 22 windows
  auto loader_opts = [](int64_t batch, int rank, int size) {
    LoaderOptions o;
    o.batch_size = batch;
    o.dp_rank = rank;
    o.dp_size = size;
    o.workers = 2;
    o.seed = 99;
    return o;
  };
  DataLoader global(data, loader_opts(6, 0, 1)), r0(data, loader_opts(3, 0, 2)),
      r1(data, loader_opts(3, 1, 2));
  ASSERT_EQ(global.batches_per_epoch(), 3);
  std::set<Tokens> epoch0;
  for (int step = 0; step < 7; ++step) {  // across two epoch boundaries
    const at::Tensor g = global.next().fields.at(0), a = r0.next().fields.at(0),
                     b = r1.next().fields.at(0);
    ASSERT_EQ(g.sizes(), (std::vector<int64_t>{6, 17}));
    EXPECT_TRUE(at::equal(at::cat({a, b}), g)) << "step " << step;
    for (int64_t r = 0; step < 3 && r < 6; ++r) epoch0.insert(row(g, r));
  }
  EXPECT_EQ(epoch0.size(), 18u);  // an epoch visits distinct windows
}

TEST_F(TokenShardTest, LlmcHeaderErrors) {
  expect_error(
      [&] { TokenShardDataset d(opts({path("errors/bad_magic.bin")}, 4, TokenFormat::kLlmc)); },
      {"bad_magic.bin", "magic 12345678", "20240520", "20240801"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/bad_magic.bin")}, 4)); },
               {"bad_magic.bin", "12345678", "20240520"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/bad_version.bin")}, 4)); },
               {"bad_version.bin", "version 2", "expected 1"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/llama_version.bin")}, 4)); },
               {"llama_version.bin", "version 1", "expected 7"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/truncated.bin")}, 4)); },
               {"truncated.bin", "100 tokens", "1224 bytes", "1144 bytes"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/oversized.bin")}, 4)); },
               {"oversized.bin", "10 tokens", "1044 bytes", "1064 bytes"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/short.bin")}, 4)); },
               {"short.bin", "100 bytes", "1024-byte"});
  expect_error(
      [&] { TokenShardDataset d(opts({path("errors/empty.bin")}, 4, TokenFormat::kLlmc)); },
      {"empty.bin", "0 bytes", "1024-byte"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/empty.bin")}, 4)); },
               {"empty.bin", "0 bytes"});
}

TEST_F(TokenShardTest, RawPathAndWindowErrors) {
  expect_error(
      [&] { TokenShardDataset d(opts({path("errors/odd_raw.bin")}, 2, TokenFormat::kRaw)); },
      {"odd_raw.bin", "7 bytes", "multiple of 2"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/empty.bin")}, 2, TokenFormat::kRaw)); },
               {"empty.bin", "0 bytes"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/empty_dir")}, 4)); },
               {"empty_dir", "no shard files", "*.bin"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/nothing_*.bin")}, 4)); },
               {"nothing_*.bin", "no regular file"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/missing.bin")}, 4)); },
               {"missing.bin", "does not exist"});
  expect_error([&] { TokenShardDataset d(opts({path("gpt2/shard_002.bin")}, 16)); },
               {"shard_002.bin: 9 tokens", "seq_len + 1 = 17", "at most 8"});
  expect_error([&] { TokenShardDataset d(opts({}, 4)); }, {"paths is empty"});
  expect_error([&] { TokenShardDataset d(opts({path("gpt2")}, 0)); }, {"seq_len is 0"});
  TokenShardOptions o = opts({path("nanogpt16")}, 8, TokenFormat::kRaw);
  o.raw_token_bytes = 3;
  expect_error([&] { TokenShardDataset d(o); },
               {"raw_token_bytes is 3", "2 (uint16", "4 (uint32)"});
  expect_error([] { parse_token_format("bin"); }, {"'bin'", "auto", "llmc", "raw", "megatron"});
  EXPECT_EQ(parse_token_format("megatron"), TokenFormat::kMegatron);
}

TEST_F(TokenShardTest, VocabAndNegativeTokens) {
  TokenShardOptions o = opts({path("errors/vocab.bin")}, 8);  // token 50300 at offset 23: window 2
  o.vocab = 50257;
  TokenShardDataset data(o);
  EXPECT_EQ(data.size(), 4);
  EXPECT_EQ(data.get_batch({0, 1, 3})[0].size(0), 3);
  expect_error(
      [&] {
        data.get_batch({0, 2});
      },
      {"vocab.bin", "token 50300", "offset 23", "vocab 50257", ">= 50301"});
  o.vocab = 0;
  TokenShardDataset unchecked(o);
  EXPECT_EQ(unchecked.get_batch({2})[0][0][7].item<int64_t>(), 50300);
  TokenShardDataset neg(opts({path("errors/signed")}, 5));
  expect_error([&] { neg.get_batch({0}); }, {"signed.bin", "token -3", "offset 2", ">= 0"});
}

TEST_F(TokenShardTest, MegatronErrors) {
  expect_error([&] { TokenShardDataset d(opts({path("errors/float_dtype.idx")}, 4)); },
               {"float_dtype.idx", "dtype code 7", "float32", "8 (uint16)"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/lonely.idx")}, 4)); },
               {"lonely.idx", "lonely.bin", "no data file"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/lonely")}, 4)); },
               {"lonely.idx", "lonely.bin"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/bad_idx_magic.bin")}, 4)); },
               {"bad_idx_magic.idx", "MMIDXXX", "MMIDIDX\\x00\\x00"});
  expect_error([&] { TokenShardDataset d(opts({path("errors/short_bin")}, 4)); },
               {"short_bin.bin", "20 bytes", "12 uint16 tokens", "24 bytes"});
  expect_error(
      [&] { TokenShardDataset d(opts({path("errors/no_index.bin")}, 4, TokenFormat::kMegatron)); },
      {"no_index.bin", "no_index.idx", "format megatron"});
}

}  // namespace
}  // namespace dtrain::engine::token_shards_test
