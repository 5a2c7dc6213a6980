// Internal to engine/train: the name tables of the models' Hugging Face adapters (hf_gpt2.cc,
// hf_llama.cc), defined in hf_checkpoint.cc. Not installed.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>

namespace dtrain::engine {

// A model's parameter names beside transformers': whole-model names, and the names within a
// block, whose index dtrain writes "blocks.<i>." and transformers "<hf_block_prefix><i>.".
struct HfNameTable {
  std::vector<std::pair<std::string, std::string>> model;  // dtrain's name, transformers' name
  std::string hf_block_prefix;
  std::vector<std::pair<std::string, std::string>> block;  // within a block: dtrain's, transformers'
  // What a name the table does not have is, after the quoted name in the error: a dtrain name,
  // a transformers name.
  std::string unknown_dtrain, unknown_hf;
};

// Splits "<prefix><index>.<rest>" (index: digits without a leading zero); false otherwise.
bool split_block_name(const std::string& name, const std::string& prefix, std::string& index, std::string& rest);

// `name` mapped through the table, from dtrain's to transformers' (to_hf) or back. dtrain::Error
// "'<shown>' <unknown_dtrain or unknown_hf>" when the table does not have it (shown: the name
// the caller was given, when it changed it first; empty: `name`).
std::string map_hf_name(const HfNameTable& table, const std::string& name, bool to_hf, const std::string& shown = "");

bool name_ends_with(const std::string& name, const std::string& tail);

// config.json's torch_dtype for `dtype` ("float32", "bfloat16", "float16"); dtrain::Error naming
// `caller` for another dtype.
const char* hf_torch_dtype(at::ScalarType dtype, const char* caller);

}  // namespace dtrain::engine
