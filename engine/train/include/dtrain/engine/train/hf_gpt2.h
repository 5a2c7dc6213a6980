// The GPT model's adapter to Hugging Face checkpoints (hf_checkpoint.h): transformers'
// GPT2LMHeadModel. Its tensor names (transformer.h.<i>.attn.c_attn.weight is
// blocks.<i>.attn.qkv.weight; the hub's original files without the "transformer." prefix load
// too), its Conv1D weights stored transposed ([in, out]), its position table cut to the model's
// seq_len on load (a table shorter than seq_len is an error naming both), its causal-mask
// buffers of older files skipped; and its config.json.
#pragma once

#include <string>

#include <c10/core/ScalarType.h>

#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/train/hf_checkpoint.h"

namespace dtrain::engine {

// For a model with options o (its seq_len decides the rows of the position table loaded).
HfNames gpt2_hf_names(const GptOptions& o);

// config.json of a GPT2LMHeadModel with o's shape (n_positions: o.seq_len), torch_dtype from
// `dtype`. Read back by gpt_options_from_hf_config to the same shape.
std::string gpt2_hf_config_json(const GptOptions& o, at::ScalarType dtype = at::kFloat);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
