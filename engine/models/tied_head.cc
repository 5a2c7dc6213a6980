#include "dtrain/engine/models/tied_head.h"

#include <ATen/ATen.h>

namespace dtrain::engine {

TiedVocabHeadImpl::TiedVocabHeadImpl(const VocabParallelEmbedding& embed, dist::Communicator& comm, bool sp)
    : spec(embed->shard_specs().at("weight")), sequence_parallel(sp), tp(&comm) {
  weight = register_parameter("weight", embed->weight);  // the same tensor: one parameter, two names
}

std::map<std::string, ShardSpec> TiedVocabHeadImpl::shard_specs() const { return {{"weight", spec}}; }

at::Tensor TiedVocabHeadImpl::forward(const at::Tensor& x) {
  // As a padded ColumnParallelLinear without bias: the gather's (or copy's) backward sums the
  // input gradient over the group.
  at::Tensor in = sequence_parallel ? gather_from_sequence_parallel(x, *tp, 1) : copy_to_tensor_parallel(x, *tp);
  return at::linear(in, weight);
}

}  // namespace dtrain::engine
