#include "dtrain/engine/train/hf_checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/state/export.h"

#include "hf_names.h"

namespace dtrain::engine {
namespace {

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string join(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK(in.good(), "cannot open '", path, "' to read");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The files an index's weight_map names, each once, in the order they first appear.
std::vector<std::string> files_of_index(const std::string& dir, const std::string& index_path) {
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(read_text(index_path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::concat("'", index_path, "' is not valid JSON (", e.what(),
                               "); it should be save_pretrained's model.safetensors.index.json"));
  }
  DTRAIN_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), "'",
               index_path, "' has no \"weight_map\" object; it should map each tensor name to its file");
  std::vector<std::string> files;
  std::set<std::string> seen;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    DTRAIN_CHECK(file.is_string(), "'", index_path, "': the file of tensor '", tensor, "' is not a string");
    const std::string name = file.get<std::string>();
    if (!seen.insert(name).second) continue;
    const std::string path = join(dir, name);
    DTRAIN_CHECK(is_file(path), "'", index_path, "' names the file '", name, "' (tensor '", tensor,
                 "'), which is not in '", dir, "'; the checkpoint is incomplete: download or copy every shard");
    files.push_back(path);
  }
  DTRAIN_CHECK(!files.empty(), "'", index_path, "' names no files");
  return files;
}

// Parameters by name, a tensor registered under two names (tied weights) under its first only;
// `aliases` gets the others.
std::vector<std::pair<std::string, at::Tensor>> distinct_parameters(torch::nn::Module& model,
                                                                    std::set<std::string>* aliases) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const void*> seen;
  for (const auto& item : model.named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) {
      if (aliases != nullptr) aliases->insert(item.key());
      continue;
    }
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

std::string hf_name_or_throw(const HfNames& names, const std::string& name) {
  DTRAIN_CHECK(static_cast<bool>(names.to_hf), "HfNames::to_hf is not set");
  return names.to_hf(name);
}

// One file's tensors into the model's parameters; `loaded` collects their dtrain names.
int64_t load_file(const std::string& file, const std::unordered_map<std::string, at::Tensor>& params,
                  const std::set<std::string>& aliases, const std::map<std::string, ShardSpec>& specs,
                  dist::Communicator& tp, const HfNames& names, bool partial, std::set<std::string>& loaded) {
  int64_t count = 0;
  at::NoGradGuard no_grad;
  for (const auto& [hf, tensor] : load_safetensors(file)) {
    if (names.ignored && names.ignored(hf)) continue;
    std::string name;
    try {
      name = names.to_dtrain(hf);
    } catch (const Error& e) {
      throw Error(detail::concat("'", file, "': tensor '", hf, "' is not a weight of this model (", e.what(),
                                 "); the checkpoint is of another architecture or configuration"));
    }
    if (aliases.count(name) > 0) continue;  // a tied copy (the head of a tied embedding)
    auto it = params.find(name);
    if (it == params.end()) {
      DTRAIN_CHECK(partial, "'", file, "': tensor '", hf, "' (dtrain's '", name,
                   "') has no parameter in this model; was it built with the checkpoint's config.json?");
      continue;  // another pipeline stage's
    }
    DTRAIN_CHECK(loaded.insert(name).second, "'", file, "': tensor '", hf, "' is given twice in the checkpoint");
    auto spec = specs.find(name);
    const at::Tensor whole = names.from_hf_tensor ? names.from_hf_tensor(name, tensor) : tensor;
    at::Tensor src = whole;
    if (spec != specs.end()) {
      try {
        src = shard_of(whole, spec->second, tp.rank(), tp.size());
      } catch (const Error&) {
        src = at::Tensor();  // a size shard_of refuses: the message below names the tensor
      }
    }
    at::Tensor param = it->second;
    DTRAIN_CHECK(src.defined() && src.sizes() == param.sizes(), "'", file, "': tensor '", hf, "' has shape ",
                 whole.sizes(),
                 (!src.defined() || spec == specs.end() || tp.size() == 1
                      ? ""
                      : " (this rank's shard " + detail::concat(src.sizes()) + ")"),
                 " but the model's '", name, "' has ", param.sizes(),
                 "; build the model with the checkpoint's config.json (its sizes differ from the shape flags)");
    param.copy_(src);
    ++count;
  }
  return count;
}

std::string shard_file_name(size_t k, size_t n) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return name;
}

}  // namespace

std::vector<std::string> hf_weight_files(const std::string& path) {
  DTRAIN_CHECK(!path.empty(), "no Hugging Face checkpoint given: pass its directory (with config.json and "
               "model.safetensors) or a .safetensors file");
  if (is_file(path)) return {path};
  DTRAIN_CHECK(is_dir(path), "'", path, "' does not exist; pass a Hugging Face checkpoint's directory or a "
               ".safetensors file");
  const std::string single = join(path, "model.safetensors");
  if (is_file(single)) return {single};
  const std::string index = join(path, "model.safetensors.index.json");
  if (is_file(index)) return files_of_index(path, index);
  const bool pickle = is_file(join(path, "pytorch_model.bin")) || is_file(join(path, "pytorch_model.bin.index.json"));
  DTRAIN_CHECK(!pickle, "'", path, "' holds a PyTorch pickle checkpoint (pytorch_model.bin); dtrain reads "
               "safetensors: convert it once with transformers (from_pretrained, then save_pretrained with "
               "safe_serialization=True)");
  throw Error(detail::concat("'", path, "' holds neither model.safetensors nor model.safetensors.index.json; ",
                             "pass the directory save_pretrained wrote (or a .safetensors file)"));
}

int64_t load_hf_weights(const std::string& path, torch::nn::Module& model, dist::Communicator& tp,
                        const HfNames& names, bool pipeline_stage) {
  DTRAIN_CHECK(static_cast<bool>(names.to_dtrain), "HfNames::to_dtrain is not set");
  const std::vector<std::string> files = hf_weight_files(path);
  std::set<std::string> aliases;
  std::unordered_map<std::string, at::Tensor> params;
  std::vector<std::string> order;
  for (auto& [name, p] : distinct_parameters(model, &aliases)) {
    params.emplace(name, p);
    order.push_back(name);
  }
  const std::map<std::string, ShardSpec> specs = collect_shard_specs(model);
  std::set<std::string> loaded;
  int64_t count = 0;
  for (const std::string& file : files) count += load_file(file, params, aliases, specs, tp, names, pipeline_stage, loaded);
  std::vector<std::string> missing;
  for (const std::string& name : order) {
    if (loaded.count(name) == 0) missing.push_back(name);
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 5; ++i) {
      list += (i ? ", '" : "'") + hf_name_or_throw(names, missing[i]) + "'";
    }
    throw Error(detail::concat("'", path, "' lacks ", missing.size(), " of the model's ", order.size(),
                               " weights (", list, missing.size() > 5 ? ", ..." : "",
                               "); the checkpoint is of a smaller or another model (check config.json's "
                               "num_hidden_layers and tie_word_embeddings)"));
  }
  return count;
}

int64_t save_hf_weights(const std::string& dir, torch::nn::Module& model, dist::Communicator& tp,
                        const HfNames& names, const HfSaveOptions& options) {
  DTRAIN_CHECK(options.max_shard_bytes > 0, "HfSaveOptions::max_shard_bytes must be positive");
  if (tp.rank() == 0) {  // fail before any collective work on a directory that cannot be written
    DTRAIN_CHECK(is_dir(dir), "'", dir, "' is not a directory; create it (mkdir -p ", dir, ") first");
    check_output_path(join(dir, "model.safetensors"), "the output directory");
  }
  const std::map<std::string, ShardSpec> specs = collect_shard_specs(model);
  NamedTensorList tensors;
  for (auto& [name, p] : distinct_parameters(model, nullptr)) {
    auto spec = specs.find(name);
    at::Tensor full = spec == specs.end() ? p.detach().cpu() : gather_full_tensor(p.detach(), spec->second, tp).cpu();
    if (names.to_hf_tensor) full = names.to_hf_tensor(name, full);
    if (options.dtype != at::ScalarType::Undefined) full = full.to(options.dtype);
    tensors.emplace_back(hf_name_or_throw(names, name), full.contiguous());
  }
  if (tp.rank() != 0) return static_cast<int64_t>(tensors.size());
  // Cut into files of at most max_shard_bytes (a tensor larger than that is a file of its own).
  std::vector<NamedTensorList> files(1);
  int64_t in_file = 0, total = 0;
  for (auto& item : tensors) {
    const int64_t bytes = static_cast<int64_t>(item.second.nbytes());
    if (in_file > 0 && in_file + bytes > options.max_shard_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(std::move(item));
    in_file += bytes;
    total += bytes;
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const std::string single = join(dir, "model.safetensors"), index = join(dir, "model.safetensors.index.json");
  if (files.size() == 1) {
    save_safetensors(single, files[0], metadata);
    ::unlink(index.c_str());  // a stale index would name files of another save
  } else {
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    for (size_t k = 0; k < files.size(); ++k) {
      save_safetensors(join(dir, shard_file_name(k, files.size())), files[k], metadata);
      for (const auto& item : files[k]) map[item.first] = shard_file_name(k, files.size());
    }
    nlohmann::ordered_json doc = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
    write_text_atomically(index, doc.dump(2) + "\n");
    ::unlink(single.c_str());  // from_pretrained would read a stale single file first
  }
  if (!options.config_json.empty()) write_text_atomically(join(dir, "config.json"), options.config_json);
  int64_t count = 0;
  for (const auto& f : files) count += static_cast<int64_t>(f.size());
  return count;
}

// ---- the tokenizer beside the weights ------------------------------------------------------

std::map<std::string, std::string> hf_tokenizer_files(const Tokenizer& tokenizer, const HfTokenizerOptions& options) {
  std::ifstream in(tokenizer.path(), std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  DTRAIN_CHECK(in.good() || in.eof(), "could not read the tokenizer ", tokenizer.path());
  nlohmann::ordered_json c = {{"tokenizer_class", "TokenizersBackend"}};
  const auto special = [&](const char* key, int64_t id) {
    if (id >= 0) c[key] = tokenizer.piece(id);
  };
  special("bos_token", tokenizer.bos_id());
  special("eos_token", tokenizer.eos_id());
  special("unk_token", tokenizer.unk_id());
  special("pad_token", tokenizer.pad_id());
  DTRAIN_CHECK(!options.add_bos || tokenizer.bos_id() >= 0, "the tokenizer ", tokenizer.path(),
               " defines no BOS piece to put before each text: export it without --bos (--bos=false)");
  DTRAIN_CHECK(!options.add_eos || tokenizer.eos_id() >= 0, "the tokenizer ", tokenizer.path(),
               " defines no EOS piece to put after each text");
  c["add_bos_token"] = options.add_bos;
  c["add_eos_token"] = options.add_eos;
  c["split_special_tokens"] = true;
  c["clean_up_tokenization_spaces"] = false;
  if (options.max_length > 0) c["model_max_length"] = options.max_length;
  const int64_t pieces = tokenizer.vocab_size();
  const int64_t vocab = options.vocab > 0 ? options.vocab : pieces;
  DTRAIN_CHECK(pieces <= vocab, "the tokenizer ", tokenizer.path(), " has ", pieces,
               " pieces, more than the model's vocabulary of ", vocab,
               ": its ids would index past the embedding. Give the tokenizer the model was trained with");
  nlohmann::ordered_json g = nlohmann::ordered_json::object();
  const auto id = [](int64_t v) { return v >= 0 ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
  g["bos_token_id"] = id(tokenizer.bos_id());
  g["eos_token_id"] = id(tokenizer.eos_id());
  if (tokenizer.pad_id() >= 0) g["pad_token_id"] = tokenizer.pad_id();
  if (vocab > pieces) {
    nlohmann::ordered_json padding = nlohmann::ordered_json::array();
    for (int64_t i = pieces; i < vocab; ++i) padding.push_back(i);
    g["suppress_tokens"] = padding;
  }
  return {{"tokenizer.model", bytes.str()},
          {"tokenizer_config.json", c.dump(2) + "\n"},
          {"generation_config.json", g.dump(2) + "\n"}};
}

void save_hf_tokenizer(const std::string& dir, const std::map<std::string, std::string>& files) {
  // The model first: a reader that finds the config finds the model it names.
  for (const char* name : {"tokenizer.model", "tokenizer_config.json", "generation_config.json"}) {
    write_text_atomically(join(dir, name), files.at(name));
  }
}

void save_hf_tokenizer(const std::string& dir, const Tokenizer& tokenizer, const HfTokenizerOptions& options) {
  save_hf_tokenizer(dir, hf_tokenizer_files(tokenizer, options));
}

std::string hf_config_with_tokenizer(const std::string& config_json, const Tokenizer& tokenizer) {
  nlohmann::ordered_json c = nlohmann::ordered_json::parse(config_json);
  const int64_t vocab = c.value("vocab_size", int64_t{0});
  DTRAIN_CHECK(tokenizer.vocab_size() <= vocab, "the tokenizer ", tokenizer.path(), " has ", tokenizer.vocab_size(),
               " pieces, more than the model's vocabulary of ", vocab,
               ": its ids would index past the embedding. Give the tokenizer the model was trained with");
  const auto id = [](int64_t v) { return v >= 0 ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
  c["bos_token_id"] = id(tokenizer.bos_id());
  c["eos_token_id"] = id(tokenizer.eos_id());
  if (tokenizer.pad_id() >= 0) c["pad_token_id"] = tokenizer.pad_id();
  return c.dump(2) + "\n";
}

// ---- the adapters' name tables (hf_names.h) ----------------------------------------------

bool split_block_name(const std::string& name, const std::string& prefix, std::string& index, std::string& rest) {
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size()) return false;
  index = name.substr(prefix.size(), dot - prefix.size());
  if (index.find_first_not_of("0123456789") != std::string::npos || (index.size() > 1 && index[0] == '0')) return false;
  rest = name.substr(dot + 1);
  return true;
}

std::string map_hf_name(const HfNameTable& table, const std::string& name, bool to_hf, const std::string& shown) {
  for (const auto& [dtrain_name, hf_name] : table.model) {
    if (name == (to_hf ? dtrain_name : hf_name)) return to_hf ? hf_name : dtrain_name;
  }
  const std::string from_prefix = to_hf ? "blocks." : table.hf_block_prefix;
  const std::string to_prefix = to_hf ? table.hf_block_prefix : "blocks.";
  std::string index, rest;
  if (split_block_name(name, from_prefix, index, rest)) {
    for (const auto& [dtrain_name, hf_name] : table.block) {
      if (rest == (to_hf ? dtrain_name : hf_name)) return to_prefix + index + "." + (to_hf ? hf_name : dtrain_name);
    }
  }
  throw Error("'" + (shown.empty() ? name : shown) + "' " + (to_hf ? table.unknown_dtrain : table.unknown_hf));
}

bool name_ends_with(const std::string& name, const std::string& tail) {
  return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

const char* hf_torch_dtype(at::ScalarType dtype, const char* caller) {
  DTRAIN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, caller,
               ": torch_dtype must be float32, bfloat16 or float16, not ", dtype);
  return dtype == at::kFloat ? "float32" : dtype == at::kBFloat16 ? "bfloat16" : "float16";
}

}  // namespace dtrain::engine
