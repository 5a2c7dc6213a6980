// The C interface between the engine's Tokenizer (data/tokenizer.cc) and
// libdtrain_sentencepiece.so (sentencepiece_shim.cc), the one library that links SentencePiece.
//
// Why a separate library behind a C interface: Debian's libsentencepiece carries its own copy of
// protobuf-lite (3.14, with exported symbols) and libdtrain_engine links the system's protobuf
// (3.21, the TensorBoard writer). Two copies in one symbol scope make SentencePiece's
// generated code check its version against the other copy and abort at start-up. The engine
// loads the shim with dlopen(RTLD_LOCAL | RTLD_DEEPBIND), so the shim and SentencePiece bind to
// their own symbols first and the engine's protobuf never sees theirs. Only C types cross: the
// buffers the shim returns were malloc'ed by the shim and go back through free_buffer.
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DTRAIN_SENTENCEPIECE_API_VERSION 1

typedef struct DtrainSentencePieceApi {
  int version;  // DTRAIN_SENTENCEPIECE_API_VERSION of the shim
  // A loaded model, or NULL with *error set (a NUL-terminated message; free_buffer it).
  void* (*load)(const char* path, char** error);
  void (*release)(void* model);
  int (*piece_size)(const void* model);
  int (*bos_id)(const void* model);  // < 0: none
  int (*eos_id)(const void* model);
  int (*pad_id)(const void* model);
  int (*unk_id)(const void* model);
  // 0 with *ids (a malloc'ed array of *count ids; NULL when the count is 0), or -1 with *error.
  // Safe to call from several threads on one model (SentencePiece's Encode is const).
  int (*encode)(const void* model, const char* text, size_t length, int** ids, size_t* count, char** error);
  // 0 with *text (malloc'ed, *length bytes and a NUL), or -1 with *error. The caller checks the
  // ids against piece_size first.
  int (*decode)(const void* model, const int* ids, size_t count, char** text, size_t* length, char** error);
  // The piece of one id (e.g. "\xe2\x96\x81the"), as decode returns text.
  int (*id_to_piece)(const void* model, int id, char** text, size_t* length, char** error);
  void (*free_buffer)(void* buffer);
} DtrainSentencePieceApi;

// The shim's one exported symbol.
const DtrainSentencePieceApi* dtrain_sentencepiece_api(void);

#ifdef __cplusplus
}
#endif
