// Sparse gradients across ranks: all_gather_rows against closed forms (uneven counts, a rank
// with none), SparseGradReducer's average against the mean of the densified gradients on both
// paths (row exchange and the dense fallback), the decision rule in closed form, and a rank
// that abandons the step while the others reduce.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/sparse_reducer.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::world_comm;

TEST(AllGatherRows, UnevenCountsInRankOrder) {
  dist::Communicator& comm = world_comm();
  const int n = comm.size(), r = comm.rank();
  // Rank r contributes r rows (rank 0 none), row j of rank r holding [100 r + j, -(100 r + j)].
  at::Tensor mine = at::empty({r, 2}, at::kFloat);
  for (int j = 0; j < r; ++j) {
    mine[j][0] = 100 * r + j;
    mine[j][1] = -(100 * r + j);
  }
  std::vector<int64_t> counts;
  at::Tensor all = dist::all_gather_rows(comm, mine, &counts);
  ASSERT_EQ(all.size(0), n * (n - 1) / 2);
  int64_t k = 0;
  for (int q = 0; q < n; ++q) {
    EXPECT_EQ(counts[q], q);
    for (int j = 0; j < q; ++j, ++k) {
      EXPECT_EQ(all[k][0].item<float>(), 100 * q + j);
      EXPECT_EQ(all[k][1].item<float>(), -(100 * q + j));
    }
  }
  // Nobody has rows: an empty result, no gather issued.
  at::Tensor none = dist::all_gather_rows(comm, at::empty({0, 3}, at::kLong));
  EXPECT_EQ(none.sizes(), (std::vector<int64_t>{0, 3}));
}

// Rank r's sparse gradient of a [V, d] embedding: rows {r, r + 1, 3, 3} (3 twice: uncoalesced).
at::Tensor rank_gradient(int r, int64_t V, int64_t d) {
  at::Tensor rows = at::tensor({static_cast<int64_t>(r) % V, (r + 1) % V, int64_t{3}, int64_t{3}});
  at::Tensor values = at::arange(4 * d, at::kFloat).reshape({4, d}).add(10 * r);
  return at::sparse_coo_tensor(rows.unsqueeze(0), values, {V, d});
}

TEST(SparseGradReducer, AveragesAsTheDenseMeanOnBothPaths) {
  dist::Communicator& comm = world_comm();
  const int n = comm.size();
  const int64_t V = 9, d = 3;
  at::Tensor want = at::zeros({V, d});
  for (int q = 0; q < n; ++q) want += rank_gradient(q, V, d).to_dense();
  want /= n;
  for (double factor : {1e30, 1e-30}) {  // always sparse, always dense
    at::Tensor w = at::zeros({V, d}).requires_grad_();
    SparseReducerOptions o;
    o.dense_factor = factor;
    SparseGradReducer reducer({w}, comm, o);
    w.mutable_grad() = rank_gradient(comm.rank(), V, d);
    reducer.reduce();
    const at::Tensor& g = w.grad();
    ASSERT_TRUE(g.defined());
    const bool sparse_path = factor > 1 || n == 1;
    EXPECT_EQ(g.is_sparse(), sparse_path);
    if (g.is_sparse()) {
      EXPECT_TRUE(g.is_coalesced());
      EXPECT_LE(g._nnz(), n + 2);  // the touched rows only: 0..n and 3
    }
    EXPECT_TRUE(at::allclose(g.to_dense(), want, 1e-6, 1e-6)) << "dense_factor " << factor;
    const SparseReduceStats& s = reducer.last_stats();
    int64_t rows = 0;  // distinct rows per rank after coalescing: {q, q + 1, 3}
    for (int q = 0; q < n; ++q) rows += 3 - (q == 3 || q + 1 == 3 ? 1 : 0);
    EXPECT_EQ(s.rows, rows);
    EXPECT_EQ(s.sparse + s.densified, 1);
    if (n > 1 && sparse_path) {
      // The gather's bus bytes: (n - 1) x the largest count (3 rows: rank 0's {0, 1, 3}) x (d floats
      // and an int64 index).
      EXPECT_EQ(s.sparse_bytes, (n - 1) * 3 * (d * 4 + 8));
    }
    if (n > 1 && !sparse_path) EXPECT_EQ(s.dense_bytes, static_cast<int64_t>(2.0 * (n - 1) / n * V * d * 4));
    reducer.zero_grad();
    EXPECT_FALSE(w.grad().defined());
  }
}

TEST(SparseGradReducer, DecisionRuleInClosedForm) {
  // 2 ranks, 1000 rows of 512 floats (2048 bytes): the all-reduce moves 2 x 1/2 x 1000 x 2048 bytes,
  // a gather of m rows moves m x 2056: dense from m > 1000 x 2048 x f / 2056.
  const int64_t row = 2048;
  EXPECT_FALSE(SparseGradReducer::choose_dense(2, 996, 1000, row, 1.0));
  EXPECT_TRUE(SparseGradReducer::choose_dense(2, 997, 1000, row, 1.0));
  EXPECT_FALSE(SparseGradReducer::choose_dense(2, 498, 1000, row, 0.5));
  EXPECT_TRUE(SparseGradReducer::choose_dense(2, 499, 1000, row, 0.5));
  // 4 ranks: the gather grows with (n - 1), the all-reduce with 2 (n - 1) / n.
  EXPECT_FALSE(SparseGradReducer::choose_dense(4, 498, 1000, row, 1.0));
  EXPECT_TRUE(SparseGradReducer::choose_dense(4, 499, 1000, row, 1.0));
  EXPECT_FALSE(SparseGradReducer::choose_dense(1, 1000, 1000, row, 1e-9));  // one rank: nothing to move
}

TEST(SparseGradReducer, DenseFallbackChosenWhereCheaper) {
  dist::Communicator& comm = world_comm();
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int64_t V = 64, d = 8;
  SparseReducerOptions o;  // the default (measured) factor
  at::Tensor w = at::zeros({V, d}).requires_grad_();
  SparseGradReducer reducer({w}, comm, o);
  // Two rows per rank: far sparser than the crossover.
  w.mutable_grad() = at::sparse_coo_tensor(at::tensor({int64_t{1}, int64_t{2}}).unsqueeze(0), at::ones({2, d}), {V, d});
  reducer.reduce();
  EXPECT_EQ(reducer.last_stats().sparse, 1);
  EXPECT_TRUE(w.grad().is_sparse());
  // Every row touched: gathering would move about as much as the all-reduce, plus indices.
  w.mutable_grad() = at::sparse_coo_tensor(at::arange(V).unsqueeze(0), at::ones({V, d}), {V, d});
  reducer.reduce();
  EXPECT_EQ(reducer.last_stats().densified, 1);
  EXPECT_FALSE(w.grad().is_sparse());
  EXPECT_TRUE(at::allclose(w.grad(), at::ones({V, d})));
}

TEST(SparseGradReducer, AbandoningRankLetsTheOthersFinish) {
  dist::Communicator& comm = world_comm();
  const int64_t V = 6, d = 2;
  at::Tensor w = at::zeros({V, d}).requires_grad_();
  SparseGradReducer reducer({w}, comm, {});
  w.mutable_grad() = rank_gradient(comm.rank(), V, d);
  if (comm.rank() == comm.size() - 1 && comm.size() > 1) {
    reducer.abandon();  // as after an out-of-memory error in backward
    EXPECT_FALSE(w.grad().defined());
  } else {
    reducer.reduce();
    EXPECT_TRUE(w.grad().defined());
  }
  comm.barrier()->wait();  // nobody is left waiting
}

TEST(SparseGradReducer, RefusesRowlessParameters) {
  at::Tensor scalar = at::zeros({}).requires_grad_();
  EXPECT_THROW(SparseGradReducer({scalar}, world_comm(), {}), Error);
}

}  // namespace
}  // namespace dtrain::engine
