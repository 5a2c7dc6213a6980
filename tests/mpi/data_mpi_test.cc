// Every rank builds its loader with its real dp_rank; the samples of each step, gathered
// from all ranks in rank order, equal the global batch of a one-rank loader with batch
// dp_size * b computed locally.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/data/data.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

std::shared_ptr<TensorDataset> counting_dataset(int64_t n) {
  return std::make_shared<TensorDataset>(std::vector<at::Tensor>{at::arange(n, at::kLong)});
}

// Gathers each rank's samples (at most b, padded with -1) and drops the padding.
at::Tensor gather_samples(dist::Communicator& comm, const at::Tensor& mine, int64_t b) {
  at::Tensor padded = at::full({b}, -1, at::kLong);
  padded.narrow(0, 0, mine.size(0)).copy_(mine);
  at::Tensor all = at::empty({comm.size() * b}, at::kLong);
  comm.all_gather(padded, all)->wait();
  return all.masked_select(all >= 0);
}

void check_union_equals_global_batch(bool drop_last, int workers) {
  dist::Communicator& comm = testing_util::world_comm();
  const int dp = comm.size();
  const int64_t b = 3, n = 10 * dp + 1;  // drop_last=false leaves a short last batch
  LoaderOptions mine;
  mine.batch_size = b;
  mine.dp_rank = comm.rank();
  mine.dp_size = dp;
  mine.seed = 99;
  mine.drop_last = drop_last;
  mine.workers = workers;
  LoaderOptions whole = mine;
  whole.batch_size = b * dp;
  whole.dp_rank = 0;
  whole.dp_size = 1;
  whole.workers = 0;
  DataLoader loader(counting_dataset(n), mine);
  DataLoader reference(counting_dataset(n), whole);
  ASSERT_EQ(loader.batches_per_epoch(), reference.batches_per_epoch());
  const int64_t steps = 2 * reference.batches_per_epoch();
  for (int64_t s = 0; s < steps; ++s) {
    Batch batch = loader.next();
    Batch global = reference.next();
    EXPECT_EQ(batch.index, global.index);
    at::Tensor gathered = gather_samples(comm, batch.fields[0], b);
    EXPECT_TRUE(at::equal(gathered, global.fields[0]))
        << "rank " << comm.rank() << " step " << s << ": gathered " << gathered << " expected "
        << global.fields[0];
  }
}

TEST(DataMpi, UnionOverRanksEqualsTheGlobalBatch) {
  check_union_equals_global_batch(/*drop_last=*/true, /*workers=*/2);
}

TEST(DataMpi, UnevenLastBatchIsSplitInRankOrder) {
  check_union_equals_global_batch(/*drop_last=*/false, /*workers=*/0);
}

}  // namespace
}  // namespace dtrain::engine
