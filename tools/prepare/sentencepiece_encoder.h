// The SentencePiece tokenizer as dtrain-prepare's Encoder (prepare.h). Only the dtrain-prepare
// program links this (and libsentencepiece): see prepare.h for why the unit tests do not.
#pragma once

#include <memory>
#include <string>

#include "prepare.h"

namespace dtrain::prepare {

// Loads a SentencePiece model file (tokenizer.model: Llama 2's, or one trained with
// sentencepiece's spm_train / SentencePieceTrainer). Throws PrepareError naming --tokenizer for
// a missing file and for a file that is not a SentencePiece model (a Hugging Face
// tokenizer.json, a tiktoken file).
std::unique_ptr<Encoder> load_sentencepiece(const std::string& path);

}  // namespace dtrain::prepare
