// libdtrain_sentencepiece.so: SentencePiece behind the C interface of sentencepiece_api.h. Plain
// C++17 with SentencePiece's headers only (no torch, no protobuf headers). Nothing throws across
// the interface: every failure becomes an error string.
#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "sentencepiece_api.h"

namespace {

using Processor = sentencepiece::SentencePieceProcessor;

const Processor& processor(const void* model) { return *static_cast<const Processor*>(model); }

// A malloc'ed copy of `bytes` with a NUL after them (NULL when malloc fails).
char* copy_out(const std::string& bytes) {
  char* out = static_cast<char*>(std::malloc(bytes.size() + 1));
  if (out == nullptr) return nullptr;
  std::memcpy(out, bytes.data(), bytes.size());
  out[bytes.size()] = '\0';
  return out;
}

void set_error(char** error, const std::string& message) {
  if (error != nullptr) *error = copy_out(message);
}

int fail(char** error, const std::string& message) {
  set_error(error, message);
  return -1;
}

int text_out(const std::string& text, char** out, size_t* length, char** error) {
  *out = copy_out(text);
  if (*out == nullptr) return fail(error, "out of memory for " + std::to_string(text.size()) + " bytes of text");
  *length = text.size();
  return 0;
}

void* load(const char* path, char** error) {
  try {
    auto* p = new Processor();
    const sentencepiece::util::Status status = p->Load(path);
    if (status.ok()) return p;
    set_error(error, status.ToString());
    delete p;
  } catch (const std::exception& e) {
    set_error(error, e.what());
  }
  return nullptr;
}

void release(void* model) { delete static_cast<Processor*>(model); }
int piece_size(const void* model) { return processor(model).GetPieceSize(); }
int bos_id(const void* model) { return processor(model).bos_id(); }
int eos_id(const void* model) { return processor(model).eos_id(); }
int pad_id(const void* model) { return processor(model).pad_id(); }
int unk_id(const void* model) { return processor(model).unk_id(); }

int encode(const void* model, const char* text, size_t length, int** ids, size_t* count, char** error) {
  try {
    std::vector<int> out;
    const sentencepiece::util::Status status = processor(model).Encode(std::string_view(text, length), &out);
    if (!status.ok()) return fail(error, status.ToString());
    *count = out.size();
    *ids = nullptr;
    if (out.empty()) return 0;
    *ids = static_cast<int*>(std::malloc(out.size() * sizeof(int)));
    if (*ids == nullptr) return fail(error, "out of memory for " + std::to_string(out.size()) + " token ids");
    std::memcpy(*ids, out.data(), out.size() * sizeof(int));
    return 0;
  } catch (const std::exception& e) {
    return fail(error, e.what());
  }
}

int decode(const void* model, const int* ids, size_t count, char** text, size_t* length, char** error) {
  try {
    std::string out;
    const sentencepiece::util::Status status = processor(model).Decode(std::vector<int>(ids, ids + count), &out);
    if (!status.ok()) return fail(error, status.ToString());
    return text_out(out, text, length, error);
  } catch (const std::exception& e) {
    return fail(error, e.what());
  }
}

int id_to_piece(const void* model, int id, char** text, size_t* length, char** error) {
  try {
    return text_out(processor(model).IdToPiece(id), text, length, error);
  } catch (const std::exception& e) {
    return fail(error, e.what());
  }
}

void free_buffer(void* buffer) { std::free(buffer); }

const DtrainSentencePieceApi kApi = {DTRAIN_SENTENCEPIECE_API_VERSION,
                                     load, release, piece_size, bos_id, eos_id, pad_id, unk_id,
                                     encode, decode, id_to_piece, free_buffer};

}  // namespace

extern "C" __attribute__((visibility("default"))) const DtrainSentencePieceApi* dtrain_sentencepiece_api(void) {
  return &kApi;
}
