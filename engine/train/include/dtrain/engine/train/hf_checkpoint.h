// Hugging Face checkpoints in and out: a model's weights as transformers' from_pretrained reads
// them and save_pretrained writes them (safetensors files, one or several with a
// model.safetensors.index.json, beside the model's config.json), through a per-model mapping of
// parameter names (models/llama.h: llama_hf_names()).
//
//   dtrain::engine::Llama model(options, mesh.tp());
//   dtrain::engine::load_hf_weights("Llama-3.2-1B/", *model, mesh.tp(), dtrain::engine::llama_hf_names());
//   ... train ...
//   dtrain::engine::save_hf_weights("out/", *model, mesh.tp(), dtrain::engine::llama_hf_names(), config_json);
//
// Tensor parallelism: every rank reads the whole tensors and keeps its shard (the layers'
// ShardSpec, padding rows zero), so a checkpoint loads at any --tp; saving gathers the shards
// (collective over tp) and writes from tp rank 0 the unsplit, unpadded weights. Tied weights
// (a head sharing the embedding's tensor) are read and written once, under the first name, as
// transformers does with tie_word_embeddings.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/data/tokenizer.h"

namespace dtrain::engine {

struct HfNames {
  // A dtrain parameter name -> its Hugging Face tensor name, and back. Each throws
  // dtrain::Error for a name that has no counterpart.
  std::function<std::string(const std::string&)> to_hf, to_dtrain;
  // Hugging Face tensors a load skips (null: none), e.g. rotary tables older files carry.
  std::function<bool(const std::string&)> ignored;
  // The whole tensor of dtrain parameter `name` from its Hugging Face tensor (a load, before
  // this rank's shard is cut), and back (a save, after the shards are gathered); null: the
  // same tensor. E.g. GPT-2's Conv1D weights are stored transposed.
  std::function<at::Tensor(const std::string& name, const at::Tensor&)> from_hf_tensor, to_hf_tensor;
};

// The safetensors files of a Hugging Face checkpoint at `path`: the file itself, or in a
// directory model.safetensors, else the files model.safetensors.index.json's weight_map names
// (each once, in the index's order). dtrain::Error naming the path and what was looked for
// when there is none (a PyTorch .bin checkpoint is named as such: convert it to safetensors).
std::vector<std::string> hf_weight_files(const std::string& path);

// Loads a Hugging Face checkpoint into `model` (built with the checkpoint's shape), converting
// each tensor to the parameter's dtype; returns the number of tensors read. File by file, so the
// host holds one file's tensors at a time. Throws dtrain::Error, naming the file and the tensor:
// a tensor of another shape (the model's shape flags differ from config.json), a tensor no
// parameter maps to (another architecture) unless names.ignored says so, one given twice, and,
// after every file, the parameters no file held. pipeline_stage: the model is one pipeline
// stage (split_pipeline_stage), and the tensors of what the other stages keep are skipped. No
// communication (every rank reads the files).
int64_t load_hf_weights(const std::string& path, torch::nn::Module& model, dist::Communicator& tp,
                        const HfNames& names, bool pipeline_stage = false);

struct HfSaveOptions {
  // Written as dir/config.json when not empty (the model's Hugging Face config).
  std::string config_json;
  // The files' dtype (e.g. bf16 for a smaller checkpoint); Undefined: each parameter's own.
  at::ScalarType dtype = at::ScalarType::Undefined;
  // A checkpoint larger than this is split into model-0000k-of-0000n.safetensors files with an
  // index (save_pretrained's max_shard_size; its default is 5 GB).
  int64_t max_shard_bytes = 5'000'000'000;
};

// Writes the model's weights into the directory `dir` (which must exist) as save_pretrained
// would: model.safetensors, or the shards and model.safetensors.index.json, plus config.json.
// Each file is written atomically (a reader never sees half of one); the index is written
// after the shards. Collective over tp (the shards are gathered); tp rank 0 writes. Returns the
// number of tensors written. Throws dtrain::Error for a parameter names.to_hf does not know
// and as check_output_path().
int64_t save_hf_weights(const std::string& dir, torch::nn::Module& model, dist::Communicator& tp,
                        const HfNames& names, const HfSaveOptions& options = {});

// The Hugging Face tokenizer of a SentencePiece model, beside a save_hf_weights() checkpoint,
// so that transformers' AutoTokenizer.from_pretrained(dir) gives the ids engine::Tokenizer (and
// Python's sentencepiece) gives: tokenizer.model (the model file's bytes) and
// tokenizer_config.json. The config names transformers' generic "TokenizersBackend" class
// (transformers 5 or later), which builds the tokenizer from the model's own normalization rule:
// "LlamaTokenizer" would apply Llama 2's instead, and a model trained with SentencePiece's default
// nmt_nfkc rule would then be encoded differently wherever spaces repeat or lead, or NFKC maps a
// character. split_special_tokens makes a "<s>" in the text text, as SentencePiece reads it.
// Also generation_config.json: the special ids and, where the model's vocabulary is padded past
// the tokenizer's pieces, those ids in suppress_tokens, so that transformers' generate() draws
// only ids the tokenizer can decode (as engine::generate() does with a tokenizer).
struct HfTokenizerOptions {
  bool add_bos = true;         // the tokenizer puts BOS before each text (add_bos_token)
  bool add_eos = false;        // and EOS after it (add_eos_token)
  int64_t max_length = 0;      // model_max_length (the model's positions); 0: not written
  int64_t vocab = 0;           // the model's vocabulary (>= the tokenizer's pieces); 0: the pieces
};
void save_hf_tokenizer(const std::string& dir, const Tokenizer& tokenizer, const HfTokenizerOptions& options = {});
// What save_hf_tokenizer writes, by file name, without writing it (its checks throw here: call
// it before writing anything else, so that a refused tokenizer leaves no half-written export),
// and the writing of those files (each atomically, the model before the configs naming it).
std::map<std::string, std::string> hf_tokenizer_files(const Tokenizer& tokenizer,
                                                      const HfTokenizerOptions& options = {});
void save_hf_tokenizer(const std::string& dir, const std::map<std::string, std::string>& files);

// `config_json` (a model's config.json) with the tokenizer's special ids: bos_token_id and
// eos_token_id (null where the tokenizer has none; transformers' generate() stops at the EOS) and
// pad_token_id where it has one. Throws dtrain::Error when the tokenizer has more pieces than the
// config's vocab_size (its ids would index past the embedding).
std::string hf_config_with_tokenizer(const std::string& config_json, const Tokenizer& tokenizer);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
