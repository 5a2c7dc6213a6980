// A language model's output head tied to its token embedding (GPT-2, Llama 3.2 1B/3B,
// tie_word_embeddings): the embedding's own weight tensor, registered as this module's "weight"
// (one tensor under two names, which trained_parameters() trains once and checkpoints keep
// under both), used as a column-parallel head without bias. The vocabulary-parallel embedding
// and a padded column-parallel head split the padded vocabulary alike, so each rank's rows of
// the one tensor are both its embedding rows and its head rows, at any tensor-parallel size.
#pragma once

#include <map>
#include <string>

#include <torch/nn/module.h>

#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine {

struct TiedVocabHeadImpl : torch::nn::Module, TensorParallelModule {
  // sequence_parallel: the input is this rank's part of the sequence, gathered first.
  TiedVocabHeadImpl(const VocabParallelEmbedding& embed, dist::Communicator& tp, bool sequence_parallel);
  at::Tensor forward(const at::Tensor& x);  // this rank's logits [B, S, padded_vocab / T]
  std::map<std::string, ShardSpec> shard_specs() const override;
  ShardSpec spec;
  bool sequence_parallel;
  dist::Communicator* tp;
  at::Tensor weight;  // the embedding's
};
TORCH_MODULE(TiedVocabHead);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
