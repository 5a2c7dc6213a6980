// dtrain::engine::Tokenizer against Python's SentencePiece (tests/reference/tokenizer_reference.py
// trains a byte-fallback BPE and a unigram model and records their encodings, decodings and
// pieces): the same ids for every text, the same text for every id list (control ids, bytes
// that form no whole character, unknown pieces), the same pieces and special ids. In this
// process, which links the engine's protobuf: SentencePiece's own protobuf must not clash with it
// (the TensorBoard writer, the engine's protobuf user, still writes after a load). The Hugging
// Face files save_hf_tokenizer writes are read by transformers' AutoTokenizer as the same model
// (tests/reference/hf_tokenizer_reference.py).
#include "dtrain/engine/data/tokenizer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/observe/tensorboard.h"
#include "dtrain/engine/train/hf_checkpoint.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::error_of;
using testing_util::ScratchDir;

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<ScratchDir>("tokenizer", true);
    ref_ = new nlohmann::json;
#ifndef DTRAIN_TEST_HAS_SENTENCEPIECE
    return;
#endif
    const std::string out = testing_util::run_python("tests/reference/tokenizer_reference.py", {dir_->str()});
    if (!out.empty()) *ref_ = nlohmann::json::parse(out);
  }
  static void TearDownTestSuite() {
    delete ref_;
    dir_.reset();
  }
  void SetUp() override {
#ifndef DTRAIN_TEST_HAS_SENTENCEPIECE
    GTEST_SKIP() << "built without SentencePiece (-DDTRAIN_WITH_SENTENCEPIECE=OFF)";
#endif
    ASSERT_EQ(ref_->size(), 2u) << "the reference script wrote nothing";
  }
  static const nlohmann::json& ref(const std::string& model) { return ref_->at(model); }
  static Tokenizer load(const std::string& model) { return Tokenizer::load(ref(model).at("path").get<std::string>()); }
  static std::string scratch(const std::string& name) { return (*dir_) / name; }

 private:
  // A static object, not a pointer: a death test's child (which runs SetUpTestSuite and leaves
  // through exit(), never reaching TearDownTestSuite) removes its directory too.
  static std::unique_ptr<ScratchDir> dir_;
  static nlohmann::json* ref_;
};
std::unique_ptr<ScratchDir> TokenizerTest::dir_;
nlohmann::json* TokenizerTest::ref_ = nullptr;

TEST_F(TokenizerTest, EncodesDecodesAndNamesPiecesAsPythonsSentencePiece) {
  for (const std::string name : {"bpe", "unigram"}) {
    SCOPED_TRACE(name);
    const nlohmann::json& r = ref(name);
    const Tokenizer tok = load(name);
    EXPECT_EQ(tok.vocab_size(), r.at("vocab").get<int64_t>());
    EXPECT_EQ(tok.bos_id(), r.at("bos").get<int64_t>());
    EXPECT_EQ(tok.eos_id(), r.at("eos").get<int64_t>());
    EXPECT_EQ(tok.pad_id(), r.at("pad").get<int64_t>());
    EXPECT_EQ(tok.unk_id(), r.at("unk").get<int64_t>());
    for (const auto& e : r.at("encode")) {
      const std::string text = e.at("text").get<std::string>();
      EXPECT_EQ(tok.encode(text), e.at("ids").get<std::vector<int64_t>>()) << "text '" << text << "'";
    }
    size_t decoded = 0;
    for (const auto& d : r.at("decode")) {
      const auto ids = d.at("ids").get<std::vector<int64_t>>();
      EXPECT_EQ(tok.decode(ids), d.at("text").get<std::string>()) << "ids " << d.at("ids").dump();
      ++decoded;
    }
    EXPECT_GE(decoded, 48u);
    const auto pieces = r.at("pieces").get<std::vector<std::string>>();
    ASSERT_EQ(static_cast<int64_t>(pieces.size()), tok.vocab_size());
    for (size_t i = 0; i < pieces.size(); ++i) EXPECT_EQ(tok.piece(static_cast<int64_t>(i)), pieces[i]) << "id " << i;
    EXPECT_NE(tok.describe().find(std::to_string(tok.vocab_size()) + " pieces"), std::string::npos) << tok.describe();
  }
}

TEST_F(TokenizerTest, CopiesShareTheModelAndThreadsEncodeAtOnce) {
  const nlohmann::json& r = ref("bpe");
  std::vector<Tokenizer> copies(4, load("bpe"));
  std::vector<int> mismatches(copies.size(), 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < copies.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 25; ++round) {
        for (const auto& e : r.at("encode")) {
          const auto ids = copies[t].encode(e.at("text").get<std::string>());
          mismatches[t] += ids != e.at("ids").get<std::vector<int64_t>>();
          if (!ids.empty()) mismatches[t] += copies[t].decode(ids).empty();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < copies.size(); ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST_F(TokenizerTest, TheEnginesProtobufStillWritesAfterSentencePieceLoaded) {
  const Tokenizer tok = load("unigram");
  ASSERT_FALSE(tok.encode("Hello world").empty());
  const std::string logs = scratch("tensorboard");
  {
    EventWriter writer(logs, /*enabled=*/true);
    writer.add_scalar("loss", 1, 2.5);
    writer.flush();
  }
  const std::string out = testing_util::run_python("tests/reference/read_tensorboard.py", {logs});
  EXPECT_NE(out.find("loss"), std::string::npos) << out;
}

// save_hf_tokenizer's files, read by transformers' AutoTokenizer, encode every reference text as
// sentencepiece does after the BOS (both models, the BPE with a pad piece, the unigram with the
// default nmt_nfkc rule's character mappings; the unigram's one known difference below) and
// decode them alike; generation_config.json suppresses the padding ids
// past the pieces; hf_config_with_tokenizer writes the special ids; a tokenizer larger than the
// model's vocabulary is refused.
TEST_F(TokenizerTest, HuggingFaceFilesEncodeAsTheModel) {
  for (const std::string name : {"bpe", "unigram"}) {
    SCOPED_TRACE(name);
    const Tokenizer tok = load(name);
    const std::string dir = scratch("hf_" + name);
    ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
    HfTokenizerOptions o;
    o.max_length = 64;
    o.vocab = tok.vocab_size() + 8;
    save_hf_tokenizer(dir, tok, o);
    const nlohmann::json r = nlohmann::json::parse(
        testing_util::run_python("tests/reference/hf_tokenizer_reference.py", {dir, tok.path()}));
    // transformers' unigram model matches control pieces in the text (a literal "<s>" is the BOS
    // id; SentencePiece reads it as text): the one text that holds them, and only it, differs
    // there. The BPE reads them as text, as SentencePiece does.
    const size_t known = name == "unigram" ? 1 : 0;
    ASSERT_EQ(r.at("mismatches").size(), known) << r.at("mismatches").dump();
    if (known == 1) EXPECT_EQ(r.at("mismatches")[0].at("text"), "<s> and </s> are text here");
    EXPECT_EQ(r.at("decode_mismatches").size(), 0u) << r.at("decode_mismatches").dump();
    EXPECT_GE(r.at("texts").get<int>() - r.at("unknown").get<int>(), 8);
    EXPECT_EQ(r.at("bos").get<int64_t>(), tok.bos_id());
    EXPECT_EQ(r.at("eos").get<int64_t>(), tok.eos_id());
    std::ifstream g(dir + "/generation_config.json");
    const nlohmann::json gen = nlohmann::json::parse(g);
    EXPECT_EQ(gen.at("eos_token_id").get<int64_t>(), tok.eos_id());
    std::vector<int64_t> padding;
    for (int64_t i = tok.vocab_size(); i < o.vocab; ++i) padding.push_back(i);
    EXPECT_EQ(gen.at("suppress_tokens").get<std::vector<int64_t>>(), padding);
    EXPECT_EQ(gen.contains("pad_token_id"), tok.pad_id() >= 0);

    const std::string config = "{\"vocab_size\": " + std::to_string(o.vocab) + "}";
    const nlohmann::json c = nlohmann::json::parse(hf_config_with_tokenizer(config, tok));
    EXPECT_EQ(c.at("bos_token_id").get<int64_t>(), tok.bos_id());
    EXPECT_EQ(c.at("eos_token_id").get<int64_t>(), tok.eos_id());
    const std::string small = "{\"vocab_size\": " + std::to_string(tok.vocab_size() - 1) + "}";
    EXPECT_NE(error_of([&] { hf_config_with_tokenizer(small, tok); }).find("more than the model's vocabulary"),
              std::string::npos);
    o.vocab = tok.vocab_size() - 1;
    EXPECT_NE(error_of([&] { save_hf_tokenizer(dir, tok, o); }).find("more than the model's vocabulary"),
              std::string::npos);
  }
}

TEST_F(TokenizerTest, BadInputNamesTheProblem) {
  const Tokenizer tok = load("bpe");
  EXPECT_NE(error_of([&] { tok.decode({5, 400}); }).find("token id 400 is outside the vocabulary"), std::string::npos);
  EXPECT_NE(error_of([&] { tok.decode({-1}); }).find("token id -1"), std::string::npos);
  EXPECT_NE(error_of([&] { tok.piece(400); }).find("ids 0..399"), std::string::npos);
  EXPECT_NE(error_of([] { Tokenizer::load(""); }).find("no tokenizer"), std::string::npos);
  EXPECT_NE(error_of([&] { Tokenizer::load(scratch("missing.model")); }).find("does not exist"), std::string::npos);
  EXPECT_NE(error_of([&] { Tokenizer::load(scratch("")); }).find("is a directory"), std::string::npos);
  const auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(scratch(name), std::ios::binary) << bytes;
    return scratch(name);
  };
  const std::string json = write("tokenizer.json", "  {\"version\": \"1.0\", \"model\": {\"type\": \"BPE\"}}");
  EXPECT_NE(error_of([&] { Tokenizer::load(json); }).find("a JSON file (a Hugging Face tokenizer.json?)"),
            std::string::npos);
  const std::string tiktoken = write("llama3.model", "IQ== 0\nIg== 1\nIw== 2\n");
  EXPECT_NE(error_of([&] { Tokenizer::load(tiktoken); }).find("a tiktoken BPE file"), std::string::npos);
  const std::string junk = write("junk.model", std::string("\x0a\x05hello\xff\xfe random bytes", 22));
  EXPECT_NE(error_of([&] { Tokenizer::load(junk); }).find("is not a SentencePiece model (SentencePiece says:"),
            std::string::npos);
}

// A fresh process (gtest's threadsafe death test re-runs the binary) so that the library is not
// loaded yet when the environment names a missing one.
TEST_F(TokenizerTest, AMissingLibraryIsReportedWithTheFix) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string model = ref("bpe").at("path").get<std::string>();
  EXPECT_EXIT(
      {
        setenv("DTRAIN_SENTENCEPIECE_LIBRARY", "/nonexistent/libdtrain_sentencepiece.so", 1);
        try {
          Tokenizer::load(model);
        } catch (const Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          std::exit(3);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(3), "cannot be loaded.*-DDTRAIN_WITH_SENTENCEPIECE=ON");
}

}  // namespace
}  // namespace dtrain::engine
