// Samples during training (train_gpt --sample_every): every N steps the model continues
// --sample_prompt, and rank 0 prints the text on stdout ("train_gpt: sample at step N (...): text"),
// as nanoGPT and llm.c print samples while they train.
// The same generate() as dtrain-generate (models/generate.h), under no_grad and in eval mode,
// with a generator of its own: the training's random draws, and so its loss curve, are those of a
// run without samples.
#pragma once

#include "common.h"
#include "model_factory.h"

#include "dtrain/engine/models/generate.h"

DECLARE_string(tokenizer);  // a SentencePiece model (also dtrain-generate's flag)

namespace dtrain::examples {

// With --sample_every > 0: checks the flags and the layout (dtrain::Error naming the fix: no
// --tokenizer, a period that is not a multiple of --log_every, a prompt and sample longer than
// --seq_len, a layout whose ranks do not hold whole blocks: --pp, --cp, --sequence_parallel,
// --shard=parameters, --offload=layers|all; the delayed offloaded update, whose weights change
// between steps) and chains the sampling after options.on_log. The
// ranks of data-parallel replica 0 generate (collective over their tensor-parallel group); the
// others go on to the next step. Without --sample_every: nothing.
void attach_samples(const Run& run, const ExampleModel& model, engine::TrainerOptions& options);

// The generation calls of an example model (the Llama's or the GPT's, vocabulary --vocab);
// dtrain::Error naming `who` for a model that cannot generate.
engine::Decoder generation_calls(const ExampleModel& model, const std::string& who);

}  // namespace dtrain::examples
