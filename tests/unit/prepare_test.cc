// dtrain-prepare (tools/prepare/) against Python's SentencePiece: tests/reference/prepare_reference.py
// trains small BPE, unigram and >65536-piece models and encodes the test texts; the shards that
// dtrain-prepare writes must hold exactly those ids (with BOS/EOS as flagged), split into the
// validation shard and train shards of the asked sizes, in llm.c's uint16 or uint32 format, and
// TokenShardDataset must read them back to the same tokens.
//
// SentencePiece itself runs in the dtrain-prepare program only: Debian's libsentencepiece
// carries its own protobuf, which cannot share a process with the engine's (prepare.h). So the
// program is run (popen) for the tokenizer's part, and the library (prepare_shards) is tested
// in-process with a table encoder that returns the reference ids of each document's text.
#include <gtest/gtest.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtrain/engine/data/token_shards.h"
#include "prepare.h"
#include "text_stream.h"
#include "test_util.h"

namespace dtrain::prepare::prepare_test {
namespace {

using Ids = std::vector<int64_t>;

struct Doc {
  std::string text;
  Ids ids;
};
struct TextEncoding {
  Doc file;
  std::vector<Doc> lines;
};
struct Model {
  std::string path;
  int64_t vocab = 0, bos = -1, eos = -1;
  std::map<std::string, TextEncoding> texts;  // by path
};

// The message of the PrepareError that fn throws ("" and a failure when none is thrown).
std::string prepare_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const PrepareError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no PrepareError thrown";
  return "";
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  const std::string msg = prepare_error(fn);
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "expected '" << p << "' in: " << msg;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string make_dir(const std::string& path) {
  ::mkdir(path.c_str(), 0755);
  return path;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

int32_t le32(const std::string& b, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return static_cast<int32_t>(v);
}

struct Shard {
  int32_t magic = 0, version = 0, count = 0;
  bool header_rest_zero = true;
  Ids tokens;
};

// Parses an llm.c shard from its bytes (not through dtrain's reader).
Shard read_shard(const std::string& path) {
  const std::string b = read_file(path);
  Shard s;
  if (b.size() < 1024) {
    ADD_FAILURE() << path << " is shorter than the 1024-byte header";
    return s;
  }
  s.magic = le32(b, 0);
  s.version = le32(b, 4);
  s.count = le32(b, 8);
  for (size_t i = 12; i < 1024; ++i) s.header_rest_zero = s.header_rest_zero && b[i] == 0;
  const size_t width = s.magic == kLlama3Magic ? 4 : 2;
  EXPECT_EQ(b.size(), 1024 + width * static_cast<size_t>(s.count)) << path;
  for (size_t at = 1024; at + width <= b.size(); at += width) {
    s.tokens.push_back(width == 4 ? static_cast<uint32_t>(le32(b, at))
                                  : static_cast<unsigned char>(b[at]) | static_cast<unsigned char>(b[at + 1]) << 8);
  }
  return s;
}

// Returns the reference ids of each document's text (the library's tokenizer, in-process).
class TableEncoder : public Encoder {
 public:
  explicit TableEncoder(const Model& m) : model_(m) {
    for (const auto& [path, t] : m.texts) {
      table_[t.file.text] = t.file.ids;
      for (const Doc& d : t.lines) table_[d.text] = d.ids;
    }
  }
  int64_t vocab_size() const override { return model_.vocab; }
  int64_t bos_id() const override { return model_.bos; }
  int64_t eos_id() const override { return model_.eos; }
  std::vector<int> encode(std::string_view text) const override {
    const auto it = table_.find(std::string(text));
    if (it == table_.end()) throw PrepareError("the reference has no document '" + std::string(text.substr(0, 40)) + "'");
    return std::vector<int>(it->second.begin(), it->second.end());
  }
  std::string describe() const override { return "the reference table of " + model_.path; }

 private:
  const Model& model_;
  std::unordered_map<std::string, Ids> table_;
};

class PrepareTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing_util::ScratchDir("prepare", true);
    models_ = new std::map<std::string, Model>;
    texts_ = new std::vector<std::string>;
    const std::string out = testing_util::run_python("tests/reference/prepare_reference.py", {dir_->str()});
    if (out.empty()) return;
    const nlohmann::json ref = nlohmann::json::parse(out);
    *texts_ = ref.at("texts").get<std::vector<std::string>>();
    for (const auto& [name, info] : ref.at("models").items()) {
      Model& m = (*models_)[name];
      m.path = info.at("path").get<std::string>();
      m.vocab = info.at("vocab").get<int64_t>();
      m.bos = info.at("bos").get<int64_t>();
      m.eos = info.at("eos").get<int64_t>();
      for (const auto& [path, e] : ref.at("encodings").at(name).items()) {
        TextEncoding& t = m.texts[path];
        t.file = {e.at("file").at("text").get<std::string>(), e.at("file").at("ids").get<Ids>()};
        for (const auto& l : e.at("lines")) t.lines.push_back({l.at("text").get<std::string>(), l.at("ids").get<Ids>()});
      }
    }
  }
  static void TearDownTestSuite() {
    delete texts_;
    delete models_;
    delete dir_;
  }
  void SetUp() override { ASSERT_EQ(models_->size(), 4u) << "the reference script wrote nothing"; }

  static const Model& model(const std::string& name) { return models_->at(name); }
  static std::string texts_dir() { return (*dir_) / "texts"; }
  // A fresh, empty directory under the scratch directory.
  static std::string fresh_dir(const std::string& name) { return make_dir((*dir_) / name); }

  // The token stream dtrain-prepare must write for `files` (in this order).
  static Ids expected_stream(const Model& m, const std::vector<std::string>& files, DocumentMode mode, bool bos,
                             bool eos) {
    Ids out;
    for (const std::string& f : files) {
      const TextEncoding& t = m.texts.at(f);
      const std::vector<Doc> docs = mode == DocumentMode::kFile ? std::vector<Doc>{t.file} : t.lines;
      for (const Doc& d : docs) {
        if (d.ids.empty()) continue;
        if (bos) out.push_back(m.bos);
        out.insert(out.end(), d.ids.begin(), d.ids.end());
        if (eos) out.push_back(m.eos);
      }
    }
    return out;
  }

  // Checks the files of `dir` are exactly the val shard (when val > 0) and the train shards of
  // <= shard tokens, in `format`, holding `stream` in order; returns the train shards' paths.
  static std::vector<std::string> expect_shards(const std::string& dir, const std::string& prefix, const Ids& stream,
                                                int64_t val, int64_t shard, const ShardFormat& format) {
    std::vector<std::string> names, train;
    std::vector<int64_t> sizes;
    const int64_t n = static_cast<int64_t>(stream.size());
    if (val > 0) {
      names.push_back(shard_name(prefix, true, 0));
      sizes.push_back(std::min(n, val));
    }
    for (int64_t at = std::min(n, val), k = 1; at < n; at += shard, ++k) {
      names.push_back(shard_name(prefix, false, k));
      sizes.push_back(std::min(shard, n - at));
      train.push_back(dir + "/" + names.back());
    }
    std::vector<std::string> sorted = names;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(entries(dir), sorted) << "the files of " << dir;
    int64_t at = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      const Shard s = read_shard(dir + "/" + names[i]);
      EXPECT_EQ(s.magic, format.magic) << names[i];
      EXPECT_EQ(s.version, format.version) << names[i];
      EXPECT_EQ(s.count, sizes[i]) << names[i];
      EXPECT_TRUE(s.header_rest_zero) << names[i];
      EXPECT_EQ(s.tokens, Ids(stream.begin() + at, stream.begin() + std::min(n, at + sizes[i]))) << names[i];
      at += sizes[i];
    }
    return train;
  }

  static inline testing_util::ScratchDir* dir_ = nullptr;
  static inline std::map<std::string, Model>* models_ = nullptr;
  static inline std::vector<std::string>* texts_ = nullptr;
};

// The program (run from this binary's directory, where the build puts both).
std::string program() {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "";
  std::string path(self, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/')) + "/dtrain-prepare";
}

struct ProgramRun {
  int status = -1;
  std::string output;  // stdout and stderr
};

ProgramRun run_program(const std::vector<std::string>& args) {
  std::string cmd = "'" + program() + "'";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " 2>&1";
  ProgramRun r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, got);
  const int rc = ::pclose(pipe);
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return r;
}

#define SKIP_WITHOUT_PROGRAM()                                                                     \
  do {                                                                                             \
    if (::access(program().c_str(), X_OK) != 0)                                                    \
      GTEST_SKIP() << program() << " is not built (configured with -DDTRAIN_WITH_SENTENCEPIECE=OFF)"; \
  } while (0)

// Each train shard read back by dtrain's TokenShardDataset: its token count and dtype, and
// every window against the shard's slice of the stream.
void expect_dataset_reads(const std::vector<std::string>& train, const Ids& train_stream, int64_t vocab,
                          const std::string& dtype) {
  const int64_t seq = 16;
  engine::TokenShardOptions o;
  o.paths = {train.front().substr(0, train.front().rfind('_')) + "_*.bin"};  // PREFIX_train_*.bin
  o.seq_len = seq;
  o.vocab = vocab;
  engine::TokenShardDataset data(o);
  ASSERT_EQ(data.shards().size(), train.size());
  EXPECT_EQ(data.total_tokens(), static_cast<int64_t>(train_stream.size()));
  int64_t sample = 0, at = 0;
  for (const engine::TokenShardInfo& s : data.shards()) {
    EXPECT_EQ(s.dtype, dtype) << s.path;
    for (int64_t w = 0; w < s.windows; ++w, ++sample) {
      const at::Tensor row = data.get_batch({sample})[0][0].contiguous();
      const Ids got(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
      const auto first = train_stream.begin() + at + w * seq;
      ASSERT_EQ(got, Ids(first, first + seq + 1)) << s.path << " window " << w;
    }
    at += s.tokens;
  }
  EXPECT_EQ(sample, data.size());
}

TEST_F(PrepareTest, ProgramMatchesPythonSentencePieceAndTheDatasetReadsItBack) {
  SKIP_WITHOUT_PROGRAM();
  struct Case {
    std::string model, documents;
    bool bos, eos;
    int64_t val, shard;
  };
  const std::vector<Case> cases = {{"bpe", "file", true, true, 37, 500},
                                   {"unigram", "lines", true, false, 0, 400},
                                   {"unigram", "file", false, true, 2000, 10000},
                                   {"big", "lines", true, true, 100, 300}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.model + " --documents=" + c.documents);
    const Model& m = model(c.model);
    const std::string out = fresh_dir("program_" + c.model + "_" + c.documents);
    const ProgramRun r = run_program({"--tokenizer=" + m.path, "--input=" + texts_dir(), "--output_dir=" + out,
                               "--prefix=corpus", "--documents=" + c.documents, "--bos=" + std::to_string(c.bos),
                               "--eos=" + std::to_string(c.eos), "--val_tokens=" + std::to_string(c.val),
                               "--shard_tokens=" + std::to_string(c.shard), "--threads=2"});
    ASSERT_EQ(r.status, 0) << r.output;
    const DocumentMode mode = parse_document_mode(c.documents);
    const Ids stream = expected_stream(m, *texts_, mode, c.bos, c.eos);
    EXPECT_NE(r.output.find(std::to_string(stream.size()) + " tokens"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("tokens/s"), std::string::npos) << r.output;
    const ShardFormat format = shard_format_for_vocab(m.vocab);
    const std::vector<std::string> train = expect_shards(out, "corpus", stream, c.val, c.shard, format);
    if (train.empty()) continue;  // all in the validation shard
    const Ids train_stream(stream.begin() + std::min<int64_t>(c.val, stream.size()), stream.end());
    expect_dataset_reads(train, train_stream, m.vocab, format.token_bytes == 2 ? "uint16" : "uint32");
  }
  EXPECT_EQ(shard_format_for_vocab(model("big").vocab).magic, kLlama3Magic);
}

TEST_F(PrepareTest, ProgramRefusesBadTokenizersAndDirectories) {
  SKIP_WITHOUT_PROGRAM();
  const std::string out = fresh_dir("program_errors");
  const std::string in = "--input=" + texts_dir();
  const auto expect = [&](const std::vector<std::string>& args, const std::vector<std::string>& parts) {
    const ProgramRun r = run_program(args);
    EXPECT_EQ(r.status, 2) << r.output;
    for (const std::string& p : parts) EXPECT_NE(r.output.find(p), std::string::npos) << "'" << p << "' in: " << r.output;
  };
  expect({"--tokenizer=" + (*dir_ / "nope.model"), in, "--output_dir=" + out}, {"--tokenizer=", "nope.model", "does not exist"});
  expect({"--tokenizer=" + texts_dir() + "/a_licence.txt", in, "--output_dir=" + out},
         {"--tokenizer=", "a_licence.txt", "is not a SentencePiece model"});
  expect({"--tokenizer=" + texts_dir(), in, "--output_dir=" + out}, {"is a directory"});
  expect({"--tokenizer=" + model("bpe").path, in, "--output_dir=" + (*dir_ / "missing")}, {"does not exist", "mkdir -p"});
  expect({"--tokenizer=" + model("plain").path, in, "--output_dir=" + out}, {"--bos=true", "no BOS", "--bos=false"});
  expect({"--tokenizer=" + model("bpe").path, "--output_dir=" + out}, {"--input is required"});
  EXPECT_TRUE(entries(out).empty());
}

// JSON Lines (--documents=jsonl), gzip and zstd: tests/reference/prepare_jsonl_reference.py writes
// the records plain, as two gzip members and as two zstd frames, with Python's json, gzip and
// zstandard, and encodes their texts; every form gives the same shard, and broken inputs name the
// file, the line and the fix.
TEST_F(PrepareTest, JsonLinesAndCompressedInputsMatchPython) {
  SKIP_WITHOUT_PROGRAM();
  const Model& m = model("bpe");
  const std::string in = fresh_dir("jsonl_inputs");
  const nlohmann::json ref =
      nlohmann::json::parse(testing_util::run_python("tests/reference/prepare_jsonl_reference.py", {in, m.path}));
  const auto stream_of = [&](const std::vector<Ids>& docs) {
    Ids out;
    for (const Ids& d : docs) {
      if (d.empty()) continue;  // a document that encodes to nothing is skipped, BOS included
      out.push_back(m.bos);
      out.insert(out.end(), d.begin(), d.end());
    }
    return out;
  };
  const ShardFormat format = shard_format_for_vocab(m.vocab);
  struct Case {
    std::string file, documents;
    Ids stream;
  };
  std::vector<Case> cases = {
      {"records.jsonl", "jsonl", stream_of(ref.at("records").get<std::vector<Ids>>())},
      {"records.jsonl.gz", "jsonl", stream_of(ref.at("records").get<std::vector<Ids>>())},
      {"lines.txt.gz", "lines", stream_of(ref.at("lines").get<std::vector<Ids>>())},
  };
  if (zstd_supported()) {
    cases.push_back({"records.jsonl.zst", "jsonl", stream_of(ref.at("records").get<std::vector<Ids>>())});
    cases.push_back({"whole.txt.zst", "file", stream_of({ref.at("whole").get<Ids>()})});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file + " --documents=" + c.documents);
    const std::string out = fresh_dir("jsonl_" + c.file);
    const ProgramRun r = run_program({"--tokenizer=" + m.path, "--input=" + in + "/" + c.file, "--output_dir=" + out,
                                      "--documents=" + c.documents, "--shard_tokens=64", "--threads=2"});
    ASSERT_EQ(r.status, 0) << r.output;
    expect_shards(out, "data", c.stream, 0, 64, format);
  }
  const auto refused = [&](const std::string& file, const std::vector<std::string>& parts,
                           const std::vector<std::string>& more = {}) {
    const std::string out = fresh_dir("jsonl_bad_" + file);
    std::vector<std::string> args = {"--tokenizer=" + m.path, "--input=" + in + "/" + file, "--output_dir=" + out,
                                     "--documents=jsonl"};
    args.insert(args.end(), more.begin(), more.end());
    const ProgramRun r = run_program(args);
    EXPECT_EQ(r.status, 2) << r.output;
    for (const std::string& p : parts) EXPECT_NE(r.output.find(p), std::string::npos) << "'" << p << "' in: " << r.output;
    EXPECT_TRUE(entries(out).empty()) << file << " left files behind";
  };
  refused("bad_json.jsonl", {"bad_json.jsonl:3 is not a JSON object", "JSON Lines"});
  refused("array.jsonl", {"array.jsonl:1 holds JSON array, not an object"});
  refused("no_field.jsonl", {"no_field.jsonl:1 has no field \"text\" (its fields: body, title)", "--jsonl_field"});
  refused("no_field.jsonl", {"has no field \"content\""}, {"--jsonl_field=content"});
  refused("number.jsonl", {"field \"text\" holds JSON number, not a string"});
  refused("cut.jsonl.gz", {"cut.jsonl.gz ends in the middle of its gzip stream", "cut short"});
  refused("garbage.jsonl.gz", {"garbage.jsonl.gz is not valid gzip data", "rename the file if it is plain text"});
  if (zstd_supported()) refused("cut.jsonl.zst", {"cut.jsonl.zst ends in the middle of its zstd stream"});
  const ProgramRun r = run_program({"--tokenizer=" + m.path, "--input=" + in + "/records.jsonl",
                                    "--output_dir=" + fresh_dir("jsonl_mode"), "--documents=json"});
  EXPECT_NE(r.output.find("or jsonl (each line a JSON object"), std::string::npos) << r.output;
}

TEST_F(PrepareTest, LibraryWritesTheReferenceStreamForEveryFlagAndThreadCount) {
  for (const char* name : {"bpe", "big"}) {
    const Model& m = model(name);
    const TableEncoder encoder(m);
    for (int combo = 0; combo < 8; ++combo) {
      PrepareOptions o;
      o.documents = combo & 1 ? DocumentMode::kLines : DocumentMode::kFile;
      o.bos = combo & 2;
      o.eos = combo & 4;
      // A glob, a file and the rest by name, in that order (a file named twice is refused).
      o.inputs = {texts_dir() + "/d_*.txt", texts_dir() + "/b_unicode.txt"};
      std::vector<std::string> files = {texts_dir() + "/d_no_newline.txt", texts_dir() + "/b_unicode.txt"};
      for (const std::string& f : *texts_) {
        if (std::find(files.begin(), files.end(), f) != files.end()) continue;
        o.inputs.push_back(f);
        files.push_back(f);
      }
      o.val_tokens = 11 * combo;
      o.shard_tokens = 297 + 100 * combo;
      o.prefix = "p";
      std::string bytes;
      for (const int threads : {1, 3}) {
        SCOPED_TRACE(std::string(name) + " combo " + std::to_string(combo) + " threads " + std::to_string(threads));
        o.threads = threads;
        o.batch_bytes = threads == 1 ? (16 << 20) : 64;  // one batch, or many small ones
        o.output_dir = fresh_dir(std::string("lib_") + name + std::to_string(combo) + "_" + std::to_string(threads));
        const PrepareSummary s = prepare_shards(o, encoder);
        const Ids stream = expected_stream(m, files, o.documents, o.bos, o.eos);
        EXPECT_EQ(s.tokens, static_cast<int64_t>(stream.size()));
        EXPECT_EQ(s.files, static_cast<int64_t>(files.size()));
        expect_shards(o.output_dir, "p", stream, o.val_tokens, o.shard_tokens, shard_format_for_vocab(m.vocab));
        std::string all;
        for (const std::string& f : entries(o.output_dir)) all += f + read_file(o.output_dir + "/" + f);
        if (threads == 1) bytes = all;
        EXPECT_TRUE(all == bytes) << "the shards differ between 1 and 3 threads";
      }
    }
  }
}

TEST_F(PrepareTest, LibrarySummaryCountsDocumentsAndShards) {
  const TableEncoder encoder(model("bpe"));
  PrepareOptions o;
  o.inputs = {texts_dir()};
  o.output_dir = fresh_dir("summary");
  o.val_tokens = 100;
  o.shard_tokens = 1000;
  const PrepareSummary s = prepare_shards(o, encoder);
  EXPECT_EQ(s.files, 5);
  EXPECT_EQ(s.documents, 4);          // c_empty.txt encodes to nothing
  EXPECT_EQ(s.skipped_documents, 1);
  EXPECT_EQ(s.val_tokens, 100);
  EXPECT_EQ(s.train_tokens, s.tokens - 100);
  ASSERT_EQ(s.shards.size(), 3u);  // 1447 tokens: val 100, train 1000 + 347
  EXPECT_EQ(s.shards[0].path, o.output_dir + "/data_val_000000.bin");
  EXPECT_EQ(s.shards[2].tokens, s.tokens - 1100);
  const std::string line = s.line(o.output_dir);
  for (const std::string& part : std::vector<std::string>{"5 files", "4 documents (1 empty skipped)",
                                                          std::to_string(s.tokens) + " tokens", "uint16, vocab 300",
                                                          "3 shards", "tokens/s"}) {
    EXPECT_NE(line.find(part), std::string::npos) << "'" << part << "' in: " << line;
  }
}

TEST_F(PrepareTest, LibraryRefusesBadInputsAndOutputDirectories) {
  const TableEncoder encoder(model("bpe"));
  const std::string bad = fresh_dir("bad_inputs");
  write_file(bad + "/binary.txt", std::string("text then a NUL\0 byte", 21));
  make_dir(bad + "/empty");
  const auto run = [&](const std::function<void(PrepareOptions&)>& change) {
    PrepareOptions o;
    o.inputs = {texts_dir()};
    o.output_dir = fresh_dir("bad_out");
    change(o);
    prepare_shards(o, encoder);
  };
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/none.txt"}; }); }, {"--input", "none.txt", "does not exist"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/binary.txt"}; }); },
               {"binary.txt", "NUL byte at offset 15", "binary file"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/binary.txt"}; o.documents = DocumentMode::kLines; }); },
               {"binary.txt", "offset 15"});
  // Not UTF-8: Latin-1 (a lone 0xE9), an overlong form, a surrogate, a cut-off sequence at the
  // end: refused by offset (they became unknown pieces without a word).
  write_file(bad + "/latin1.txt", "caf\xe9 au lait");
  write_file(bad + "/overlong.txt", "ok\nslash \xc0\xaf here");
  write_file(bad + "/surrogate.txt", "x \xed\xa0\x80");
  write_file(bad + "/cut.txt", "fine \xe2\x82");
  write_file(bad + "/valid.txt", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x99\x82 \xf4\x8f\xbf\xbf");
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/latin1.txt"}; }); },
               {"latin1.txt is not UTF-8 text: byte 0xE9 at offset 3", "iconv"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/overlong.txt"}; o.documents = DocumentMode::kLines; }); },
               {"overlong.txt", "byte 0xC0 at offset 9"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/surrogate.txt"}; }); }, {"byte 0xED at offset 2"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/cut.txt"}; }); }, {"byte 0xE2 at offset 5"});
  // Well-formed UTF-8 passes the check (and reaches the test's table encoder, which knows only
  // the reference texts).
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/valid.txt"}; }); }, {"the reference has no document"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/valid.txt", bad + "/*.txt"}; }); },
               {"--input names", "valid.txt twice", "encoded twice"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/empty"}; }); }, {"empty", "no regular files"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {bad + "/*.nothing"}; }); }, {"matches no regular file"});
  expect_error([&] { run([&](PrepareOptions& o) { o.inputs = {texts_dir() + "/c_empty.txt"}; }); }, {"hold no text"});
  expect_error([&] { run([&](PrepareOptions& o) { o.output_dir = bad + "/missing"; }); },
               {"--output_dir=", "does not exist", "mkdir -p"});
  expect_error([&] { run([&](PrepareOptions& o) { o.output_dir = bad + "/binary.txt"; }); }, {"is not a directory"});
  expect_error([&] { run([&](PrepareOptions& o) { o.shard_tokens = 0; }); }, {"--shard_tokens=0"});
  expect_error([&] { run([&](PrepareOptions& o) { o.shard_tokens = int64_t{1} << 31; }); }, {"--shard_tokens=", "int32"});
  expect_error([&] { run([&](PrepareOptions& o) { o.val_tokens = -1; }); }, {"--val_tokens=-1"});
  expect_error([&] { run([&](PrepareOptions& o) { o.prefix = "a/b"; }); }, {"--prefix"});
  expect_error([] { parse_document_mode("paragraphs"); }, {"--documents=paragraphs", "file", "lines"});
  const TableEncoder plain(model("plain"));
  PrepareOptions o;
  o.inputs = {texts_dir()};
  o.output_dir = fresh_dir("no_specials");
  expect_error([&] { prepare_shards(o, plain); }, {"--bos=true", "no BOS id", "--bos=false"});
  o.bos = false;
  o.eos = true;
  expect_error([&] { prepare_shards(o, plain); }, {"--eos=true", "no EOS id", "--eos=false"});
  EXPECT_TRUE(entries(o.output_dir).empty());
}

TEST_F(PrepareTest, LibraryNeverOverwritesShardsAndLeavesNothingOnFailure) {
  const TableEncoder encoder(model("bpe"));
  PrepareOptions o;
  o.inputs = {texts_dir()};
  o.output_dir = fresh_dir("twice");
  o.prefix = "corpus";
  o.val_tokens = 10;
  prepare_shards(o, encoder);
  const std::vector<std::string> first = entries(o.output_dir);
  const std::string before = read_file(o.output_dir + "/corpus_val_000000.bin");
  expect_error([&] { prepare_shards(o, encoder); },
               {"already holds shards of --prefix=corpus", "corpus_train_000001.bin", "remove them", "another --prefix"});
  EXPECT_EQ(entries(o.output_dir), first);
  EXPECT_EQ(read_file(o.output_dir + "/corpus_val_000000.bin"), before);
  o.prefix = "other";  // another prefix beside them is fine
  EXPECT_GT(prepare_shards(o, encoder).tokens, 0);

  // A binary file after enough text for several shards: the error removes the finished shards
  // and the temporary file of the one in progress.
  const std::string bad = fresh_dir("fail_late");
  write_file(bad + "/z_binary.txt", std::string("\0\1\2", 3));
  o.inputs = {texts_dir(), bad + "/z_binary.txt"};
  o.output_dir = fresh_dir("fail_late_out");
  o.shard_tokens = 100;
  o.batch_bytes = 1;  // a batch per document: shards are written before the bad file is read
  expect_error([&] { prepare_shards(o, encoder); }, {"z_binary.txt", "NUL byte at offset 0", "were removed"});
  EXPECT_TRUE(entries(o.output_dir).empty()) << entries(o.output_dir).size() << " files left";
}

// Every file of dir, names and bytes, in name order.
std::string directory_bytes(const std::string& dir) {
  std::string all;
  for (const std::string& f : entries(dir)) all += f + '\n' + read_file(dir + "/" + f);
  return all;
}

TEST_F(PrepareTest, ProgressLineLeavesTheShardsAsTheyAre) {
  const TableEncoder encoder(model("bpe"));
  for (const int threads : {1, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    PrepareOptions o;
    o.inputs = {texts_dir()};
    o.documents = DocumentMode::kLines;
    o.val_tokens = 50;
    o.shard_tokens = 300;
    o.threads = threads;
    o.batch_bytes = 64;
    const std::string off_dir = fresh_dir("progress_off_" + std::to_string(threads));
    o.output_dir = off_dir;
    const PrepareSummary off = prepare_shards(o, encoder);
    std::FILE* out = std::tmpfile();
    ASSERT_NE(out, nullptr);
    o.progress_to = out;
    o.output_dir = fresh_dir("progress_on_" + std::to_string(threads));
    const PrepareSummary on = prepare_shards(o, encoder);
    std::string text(static_cast<size_t>(std::ftell(out)), '\0');
    std::rewind(out);
    ASSERT_EQ(std::fread(text.data(), 1, text.size(), out), text.size());
    std::fclose(out);
    EXPECT_EQ(directory_bytes(o.output_dir), directory_bytes(off_dir));
    EXPECT_EQ(on.tokens, off.tokens);
    EXPECT_EQ(on.documents, off.documents);
    // Lines redrawn with '\r', the last one complete and ended by one newline.
    ASSERT_GE(text.size(), 2u) << text;
    EXPECT_EQ(text[0], '\r');
    EXPECT_EQ(text.find('\n'), text.size() - 1) << text;
    const std::string last = text.substr(text.rfind('\r') + 1);
    EXPECT_EQ(last.rfind("[##########] 100% ", 0), 0u) << last;
    // The counts as the line writes them: "... 0/0 B 55 docs 1.49k tok ...".
    const std::string ref = format_progress({0, 0, on.documents, on.tokens, 1.0, true});
    const size_t from = ref.find(" B ") + 2;
    const std::string counts = ref.substr(from, ref.find(" tok ") + 5 - from);
    EXPECT_NE(last.find(counts), std::string::npos) << "'" << counts << "' in: " << last;
    EXPECT_NE(last.find(" done"), std::string::npos) << last;
  }
}

TEST_F(PrepareTest, ProgramDrawsProgressOnlyWhenAsked) {
  SKIP_WITHOUT_PROGRAM();
  std::string shards;
  for (const std::string flag : {"", "--progress=false", "--progress=true"}) {
    SCOPED_TRACE("'" + flag + "'");
    const std::string out = fresh_dir("program_progress" + flag.substr(std::min<size_t>(flag.size(), 10)));
    std::vector<std::string> args = {"--tokenizer=" + model("bpe").path, "--input=" + texts_dir(),
                                     "--output_dir=" + out, "--val_tokens=40", "--shard_tokens=500", "--threads=2"};
    if (!flag.empty()) args.push_back(flag);
    const ProgramRun r = run_program(args);  // stderr is a pipe: no progress unless --progress=true
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("dtrain-prepare: 5 files, 4 documents"), std::string::npos) << r.output;
    const bool drawn = r.output.find("\r[") != std::string::npos;
    EXPECT_EQ(drawn, flag == "--progress=true") << r.output;
    if (drawn) {  // the last line: "... 4 docs ... done", padded with blanks, a newline, then the summary
      const size_t done = r.output.find(" done");
      ASSERT_NE(done, std::string::npos) << r.output;
      EXPECT_NE(r.output.rfind(" 4 docs ", done), std::string::npos) << r.output;
      const size_t newline = r.output.find_first_not_of(' ', done + 5);
      EXPECT_EQ(r.output.compare(newline, 24, "\ndtrain-prepare: 5 files"), 0) << r.output;
    }
    if (shards.empty()) shards = directory_bytes(out);
    EXPECT_EQ(directory_bytes(out), shards);
  }
}

TEST(PrepareProgress, FormatsOneLineForAnEightyColumnTerminal) {
  ProgressSnapshot p;
  p.bytes = 18'200'000;
  p.total_bytes = 35'100'000;
  p.documents = 1234;
  p.tokens = 4'560'000;
  p.seconds = 12.5;
  EXPECT_EQ(format_progress(p), "[#####-----] 51% 18.2/35.1 MB 1.23k docs 4.56M tok 365k tok/s 0:12 ETA 0:11");
  EXPECT_EQ(format_progress({0, 1000, 0, 0, 0.0, false}),
            "[----------] 0% 0.00/1.00 kB 0 docs 0 tok 0 tok/s 0:00 ETA ?");
  EXPECT_EQ(format_progress({250, 500, 3, 70, 2.0, false}),
            "[#####-----] 50% 250/500 B 3 docs 70 tok 35 tok/s 0:02 ETA 0:02");
  EXPECT_EQ(format_progress({35'100'000, 35'100'000, 5000, 9'999'999, 30.0, true}),
            "[##########] 100% 35.1/35.1 MB 5.00k docs 10.0M tok 333k tok/s 0:30 done");
  EXPECT_EQ(format_progress({300'000'000, 1'500'000'000, 999, 999'499, 4000.0, false}),
            "[##--------] 20% 0.30/1.50 GB 999 docs 999k tok 250 tok/s 1h06m ETA 4h26m");
  EXPECT_EQ(format_progress({2000, 1000, 1, 1, 1.0, false}).substr(0, 17), "[##########] 100%");  // a file grew
  // The widest lines: 79 columns while the counts stay under 1000 G and the times under 10 hours.
  size_t widest = 0;
  for (const double total : {999.0, 45.6e3, 999e6, 45.6e9, 998e9}) {
    for (const double share : {0.0, 0.456, 0.999}) {
      for (const double count : {999.0, 45.6e3, 45.6e6, 998e9}) {
        for (const double seconds : {0.0, 59.0, 3599.0, 35999.0}) {
          const ProgressSnapshot q{static_cast<int64_t>(total * share), static_cast<int64_t>(total),
                                   static_cast<int64_t>(count), static_cast<int64_t>(count), seconds, false};
          if (share > 0 && seconds * (1 - share) / share >= 36000) continue;
          const std::string line = format_progress(q);
          EXPECT_LE(line.size(), 79u) << line;
          widest = std::max(widest, line.size());
        }
      }
    }
  }
  EXPECT_GE(widest, 76u);
}

TEST(PrepareShardWriter, WritesAtomicallyAndRefusesToReplaceAFile) {
  testing_util::ScratchDir dir("prepare_writer", true);
  const std::string path = dir / "x_train_000001.bin";
  {
    ShardWriter w(path, shard_format_for_vocab(70000), 70000);
    const std::vector<int> t = {0, 65535, 65536, 69999};
    w.append(t.data(), t.size());
    EXPECT_EQ(entries(dir.str()).size(), 1u);
    EXPECT_EQ(entries(dir.str())[0].rfind(".x_train_000001.bin.tmp.", 0), 0u) << entries(dir.str())[0];
    w.commit();
  }
  EXPECT_EQ(entries(dir.str()), std::vector<std::string>{"x_train_000001.bin"});
  const Shard s = read_shard(path);
  EXPECT_EQ(s.magic, 20240801);
  EXPECT_EQ(s.version, 7);
  EXPECT_EQ(s.tokens, (Ids{0, 65535, 65536, 69999}));
  {
    ShardWriter w(path, shard_format_for_vocab(300), 300);
    const int t = 5;
    w.append(&t, 1);
    expect_error([&] { w.commit(); }, {"x_train_000001.bin", "appeared while it was being written"});
  }
  EXPECT_EQ(entries(dir.str()), std::vector<std::string>{"x_train_000001.bin"});
  EXPECT_EQ(read_shard(path).tokens, (Ids{0, 65535, 65536, 69999}));
  {
    ShardWriter w(dir / "y.bin", shard_format_for_vocab(300), 300);
    const int t = 300;
    expect_error([&] { w.append(&t, 1); }, {"id 300", "outside its vocabulary [0, 300)"});
  }  // not committed: the temporary file goes
  EXPECT_EQ(entries(dir.str()), std::vector<std::string>{"x_train_000001.bin"});
  const ShardFormat small = shard_format_for_vocab(65536);
  EXPECT_EQ(small.magic, 20240520);
  EXPECT_EQ(small.version, 1);
  EXPECT_EQ(small.token_bytes, 2);
  EXPECT_EQ(shard_format_for_vocab(65537).token_bytes, 4);
}

}  // namespace
}  // namespace dtrain::prepare::prepare_test
