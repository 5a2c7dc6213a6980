// Text to token ids and back with a SentencePiece model (Llama 1 and 2's, Mistral's, TinyLlama's
// tokenizer.model, or one trained with sentencepiece's spm_train / SentencePieceTrainer, as
// dtrain-prepare uses): the same ids as Python's sentencepiece.SentencePieceProcessor.
//
//   auto tok = dtrain::engine::Tokenizer::load("tokenizer.model");
//   std::vector<int64_t> ids = tok.encode("Hello world");   // no BOS/EOS: add tok.bos_id() yourself
//   std::string text = tok.decode(ids);                      // control ids (BOS, EOS) decode to ""
//
// SentencePiece runs in libdtrain_sentencepiece.so, a library beside libdtrain_engine.so that
// the engine loads on the first load() (data/sentencepiece/sentencepiece_api.h says why it is
// kept apart: SentencePiece's own copy of protobuf), with dlopen's RTLD_DEEPBIND (glibc; a process
// under AddressSanitizer cannot load it so). The environment variable
// DTRAIN_SENTENCEPIECE_LIBRARY names another path for it.
//
// Threads: a Tokenizer is immutable; encode, decode and piece may run on several threads at
// once. Copies share the loaded model, which is freed with the last copy.
//
// Errors (dtrain::Error naming the file and the fix): a model path that does not exist or is a
// directory; a Hugging Face tokenizer.json or a tiktoken file (Llama 3's tokenizer.model) in
// place of a SentencePiece model; a file SentencePiece cannot read; an engine built without
// SentencePiece (the library is missing: install libsentencepiece-dev with cluster/setup.sh and
// configure with -DDTRAIN_WITH_SENTENCEPIECE=ON); decode or piece of an id outside
// [0, vocab_size()).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::engine {

class Tokenizer {
 public:
  // Loads a SentencePiece model file. Synchronous; throws dtrain::Error (above).
  static Tokenizer load(const std::string& path);

  int64_t vocab_size() const;  // the model's pieces: ids are [0, vocab_size())
  int64_t bos_id() const;      // -1 when the model has none
  int64_t eos_id() const;
  int64_t pad_id() const;
  int64_t unk_id() const;

  // The ids of `text` (UTF-8), without BOS or EOS.
  std::vector<int64_t> encode(std::string_view text) const;
  // The text of `ids`; BOS, EOS and other control ids give no text.
  std::string decode(const std::vector<int64_t>& ids) const;
  // One id's piece as the model stores it (SentencePiece writes a leading space as U+2581).
  std::string piece(int64_t id) const;

  const std::string& path() const;
  // "SentencePiece tokenizer.model (32000 pieces, bos 1, eos 2)".
  std::string describe() const;

 private:
  struct Model;
  explicit Tokenizer(std::shared_ptr<const Model> model);
  void check_id(int64_t id, const char* call) const;
  // The shim's text out of `call` (text, length, error), freed there; throws naming `what`.
  std::string text_of(const std::string& what, const std::function<int(char**, size_t*, char**)>& call) const;
  std::shared_ptr<const Model> model_;
};

}  // namespace dtrain::engine
