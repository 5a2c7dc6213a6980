// SentencePiece as dtrain-prepare's Encoder (sentencepiece_encoder.h).
#include "sentencepiece_encoder.h"

#include <sentencepiece_processor.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

namespace dtrain::prepare {
namespace {

class SentencePieceEncoder : public Encoder {
 public:
  explicit SentencePieceEncoder(const std::string& path) : path_(path) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      throw PrepareError("--tokenizer=" + path + " does not exist (" + std::strerror(errno) +
                         "): name a SentencePiece model file (tokenizer.model)");
    }
    if (S_ISDIR(st.st_mode)) {
      throw PrepareError("--tokenizer=" + path + " is a directory: name the SentencePiece model file in it (tokenizer.model)");
    }
    const sentencepiece::util::Status status = processor_.Load(path);
    if (!status.ok()) {
      throw PrepareError("--tokenizer=" + path + " is not a SentencePiece model (SentencePiece says: " +
                         status.ToString() +
                         "); dtrain-prepare reads SentencePiece .model files such as Llama 2's tokenizer.model, not a "
                         "Hugging Face tokenizer.json or a tiktoken file (Llama 3's tokenizer.model): for those, "
                         "tools/prepare_hf.py takes the same flags and writes the same shards");
    }
  }

  int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  int64_t bos_id() const override { return processor_.bos_id(); }
  int64_t eos_id() const override { return processor_.eos_id(); }

  std::vector<int> encode(std::string_view text) const override {
    std::vector<int> ids;
    const sentencepiece::util::Status status = processor_.Encode(text, &ids);
    if (!status.ok()) throw PrepareError("SentencePiece failed: " + status.ToString());
    return ids;
  }

  std::string describe() const override {
    return "SentencePiece " + path_ + ", " + std::to_string(vocab_size()) + " pieces";
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor processor_;
};

}  // namespace

std::unique_ptr<Encoder> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceEncoder>(path);
}

}  // namespace dtrain::prepare
