// Tokenizer (tokenizer.h): SentencePiece through libdtrain_sentencepiece.so, loaded once with
// dlopen(RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND) and never unloaded (sentencepiece_api.h).
#include "dtrain/engine/data/tokenizer.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>

#include "dtrain/dist/error.h"
#include "sentencepiece/sentencepiece_api.h"

namespace dtrain::engine {
namespace {

constexpr const char* kLibraryName = "libdtrain_sentencepiece.so";

// The shim beside the library this code is in (libdtrain_engine.so), or the environment's choice.
std::string library_path() {
  if (const char* env = std::getenv("DTRAIN_SENTENCEPIECE_LIBRARY"); env != nullptr && *env != '\0') return env;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&library_path), &info) != 0 && info.dli_fname != nullptr) {
    std::string self = info.dli_fname;
    const size_t slash = self.rfind('/');
    if (slash != std::string::npos) return self.substr(0, slash + 1) + kLibraryName;
  }
  return kLibraryName;  // the dynamic linker's search path
}

const DtrainSentencePieceApi& api() {
  static std::mutex mutex;
  static const DtrainSentencePieceApi* loaded = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded != nullptr) return *loaded;
  const std::string path = library_path();
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (handle == nullptr) {
    const char* why = dlerror();
    throw Error("the SentencePiece tokenizer library " + path + " cannot be loaded (" + (why ? why : "?") +
                "): dtrain was built without SentencePiece, or the library was not installed beside "
                "libdtrain_engine.so. Install libsentencepiece-dev (bash cluster/setup.sh) and configure with "
                "-DDTRAIN_WITH_SENTENCEPIECE=ON, or name the library in DTRAIN_SENTENCEPIECE_LIBRARY");
  }
  using Entry = const DtrainSentencePieceApi* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(handle, "dtrain_sentencepiece_api"));
  DTRAIN_CHECK(entry != nullptr, path, " has no dtrain_sentencepiece_api(): it is not dtrain's SentencePiece library");
  const DtrainSentencePieceApi* a = entry();
  DTRAIN_CHECK(a != nullptr && a->version == DTRAIN_SENTENCEPIECE_API_VERSION, path, " speaks version ",
               a ? a->version : -1, " of the tokenizer interface, this engine ", DTRAIN_SENTENCEPIECE_API_VERSION,
               ": it belongs to another dtrain build; rebuild and install both together");
  loaded = a;  // the handle stays open for the process's life
  return *loaded;
}

// The shim's error string as a std::string (and freed).
std::string take_error(const DtrainSentencePieceApi& a, char* error) {
  std::string out = error ? error : "unknown error";
  a.free_buffer(error);
  return out;
}

// What the file looks like when it is not a SentencePiece model ("" when it may be one).
std::string other_format(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string head(256, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  const size_t first = head.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && head[first] == '{') {
    return "a JSON file (a Hugging Face tokenizer.json?)";
  }
  // tiktoken's BPE files (Llama 3's tokenizer.model): lines "<base64 bytes> <rank>".
  const size_t eol = head.find('\n');
  if (eol != std::string::npos && eol > 0) {
    const std::string line = head.substr(0, eol);
    const size_t space = line.find(' ');
    const auto base64 = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '='; };
    bool looks = space != std::string::npos && space > 0 && space + 1 < line.size();
    for (size_t i = 0; looks && i < space; ++i) looks = base64(line[i]);
    for (size_t i = space + 1; looks && i < line.size(); ++i) looks = std::isdigit(static_cast<unsigned char>(line[i]));
    if (looks) return "a tiktoken BPE file (Llama 3's tokenizer.model is one)";
  }
  return "";
}

}  // namespace

struct Tokenizer::Model {
  const DtrainSentencePieceApi* api = nullptr;
  void* handle = nullptr;
  std::string path;
  int64_t vocab = 0, bos = -1, eos = -1, pad = -1, unk = -1;
  Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  ~Model() {
    if (handle != nullptr) api->release(handle);
  }
};

Tokenizer::Tokenizer(std::shared_ptr<const Model> model) : model_(std::move(model)) {}

Tokenizer Tokenizer::load(const std::string& path) {
  struct stat st {};
  DTRAIN_CHECK(!path.empty(), "no tokenizer: name a SentencePiece model file (tokenizer.model)");
  DTRAIN_CHECK(::stat(path.c_str(), &st) == 0, "tokenizer ", path, " does not exist (", std::strerror(errno),
               "): name a SentencePiece model file (tokenizer.model)");
  DTRAIN_CHECK(!S_ISDIR(st.st_mode), "tokenizer ", path, " is a directory: name the SentencePiece model file in it "
               "(tokenizer.model)");
  const std::string other = other_format(path);
  DTRAIN_CHECK(other.empty(), "tokenizer ", path, " is ", other, ", not a SentencePiece model: dtrain reads "
               "SentencePiece .model files (Llama 2's, Mistral's tokenizer.model, or one trained with sentencepiece)");
  const DtrainSentencePieceApi& a = api();
  auto model = std::make_shared<Model>();
  model->api = &a;
  model->path = path;
  char* error = nullptr;
  model->handle = a.load(path.c_str(), &error);
  if (model->handle == nullptr) {
    throw Error("tokenizer " + path + " is not a SentencePiece model (SentencePiece says: " + take_error(a, error) +
                "): dtrain reads SentencePiece .model files such as Llama 2's tokenizer.model");
  }
  model->vocab = a.piece_size(model->handle);
  model->bos = a.bos_id(model->handle);
  model->eos = a.eos_id(model->handle);
  model->pad = a.pad_id(model->handle);
  model->unk = a.unk_id(model->handle);
  return Tokenizer(std::move(model));
}

int64_t Tokenizer::vocab_size() const { return model_->vocab; }
int64_t Tokenizer::bos_id() const { return model_->bos < 0 ? -1 : model_->bos; }
int64_t Tokenizer::eos_id() const { return model_->eos < 0 ? -1 : model_->eos; }
int64_t Tokenizer::pad_id() const { return model_->pad < 0 ? -1 : model_->pad; }
int64_t Tokenizer::unk_id() const { return model_->unk < 0 ? -1 : model_->unk; }
const std::string& Tokenizer::path() const { return model_->path; }

std::string Tokenizer::describe() const {
  std::string out = "SentencePiece " + model_->path + " (" + std::to_string(vocab_size()) + " pieces";
  if (bos_id() >= 0) out += ", bos " + std::to_string(bos_id());
  if (eos_id() >= 0) out += ", eos " + std::to_string(eos_id());
  return out + ")";
}

void Tokenizer::check_id(int64_t id, const char* call) const {
  DTRAIN_CHECK(id >= 0 && id < model_->vocab, "Tokenizer::", call, ": token id ", id, " is outside the vocabulary of ",
               model_->path, " (", model_->vocab, " pieces: ids 0..", model_->vocab - 1,
               "); was the model trained with another tokenizer, or a larger --vocab?");
}

std::vector<int64_t> Tokenizer::encode(std::string_view text) const {
  const DtrainSentencePieceApi& a = *model_->api;
  int* ids = nullptr;
  size_t count = 0;
  char* error = nullptr;
  if (a.encode(model_->handle, text.data(), text.size(), &ids, &count, &error) != 0) {
    throw Error("tokenizer " + model_->path + ": encoding failed: " + take_error(a, error));
  }
  std::vector<int64_t> out(ids, ids + count);
  a.free_buffer(ids);
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::vector<int> narrow;
  narrow.reserve(ids.size());
  for (int64_t id : ids) {
    check_id(id, "decode");
    narrow.push_back(static_cast<int>(id));
  }
  return text_of("decoding", [&](char** text, size_t* length, char** error) {
    return model_->api->decode(model_->handle, narrow.data(), narrow.size(), text, length, error);
  });
}

std::string Tokenizer::piece(int64_t id) const {
  check_id(id, "piece");
  return text_of("piece " + std::to_string(id), [&](char** text, size_t* length, char** error) {
    return model_->api->id_to_piece(model_->handle, static_cast<int>(id), text, length, error);
  });
}

std::string Tokenizer::text_of(const std::string& what,
                               const std::function<int(char**, size_t*, char**)>& call) const {
  char* text = nullptr;
  size_t length = 0;
  char* error = nullptr;
  if (call(&text, &length, &error) != 0) {
    throw Error("tokenizer " + model_->path + ": " + what + " failed: " + take_error(*model_->api, error));
  }
  std::string out(text, length);
  model_->api->free_buffer(text);
  return out;
}

}  // namespace dtrain::engine
