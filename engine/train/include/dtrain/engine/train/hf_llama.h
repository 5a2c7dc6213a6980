// The Llama model's adapter to Hugging Face checkpoints (hf_checkpoint.h): its tensor names
// (llama_hf_name, llama_dtrain_name; older checkpoints' rotary tables skipped)
// and its config.json, as transformers' LlamaConfig writes it.
#pragma once

#include <string>

#include <c10/core/ScalarType.h>

#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/train/hf_checkpoint.h"

namespace dtrain::engine {

// The Hugging Face name of a dtrain parameter name of this model (whole, unsplit weights), and
// back: "blocks.3.attn.q.weight" <-> "model.layers.3.self_attn.q_proj.weight", "embed.weight"
// <-> "model.embed_tokens.weight", "head.weight" <-> "lm_head.weight", ... dtrain::Error for a
// name of neither model (e.g. the rotary "inv_freq" buffers older checkpoints carry).
std::string llama_hf_name(const std::string& dtrain_name);
std::string llama_dtrain_name(const std::string& hf_name);

HfNames llama_hf_names();

// config.json of a LlamaForCausalLM with o's shape (max_position_embeddings: o.seq_len; the
// Llama 3 rope scaling when o.rope_factor > 0), torch_dtype from `dtype`. Read back by
// llama_options_from_hf_config to the same options (sequence_parallel aside).
std::string llama_hf_config_json(const LlamaOptions& o, at::ScalarType dtype = at::kFloat);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
