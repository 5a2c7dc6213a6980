// Data-parallel averaging of sparse gradients (COO, as embeddings with sparse=true produce:
// the rows a step touched), without densifying them, as DDP does for sparse parameters (over
// gloo) in buckets of their own.
//
// After the synchronized backward, for each parameter in order: the local gradient is
// coalesced; the ranks exchange their row counts; then either
//   sparse: every rank's row indices and rows are gathered (all_gather_rows: padded to the
//           largest count), summed by coalescing and divided by the group size, so the
//           gradient stays a coalesced sparse tensor of the touched rows; or
//   dense:  the gradient is densified and all-reduced (averaged), when that moves fewer bytes
//           than the gather would, times SparseReducerOptions::dense_factor (a measured
//           constant: the sparse path also pays for the coalescing; docs/BENCHMARKS.md).
// Every rank computes the same choice from the same counts. A parameter whose gradient is
// already dense (or undefined: no row touched) takes part with what it has.
//
// Synchronous: it runs after the dense buckets were reduced (GradReducer), on the same
// communicator, so every rank issues the same sequence. Not overlapped with backward.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/communicator.h"

namespace torch::nn {
class Module;
}

namespace dtrain::engine {

struct SparseReducerOptions {
  // Reduce densely when the sparse path's bus bytes exceed dense_factor x the dense all-reduce's.
  // Measured (dtrain-bench sparse, 2 ranks over MPI on the CPU, a 32000 x 512 float32
  // embedding): the two paths take equal time when the gather moves about 0.33 x the
  // all-reduce's bytes (0.33 and 0.36 in two runs), because coalescing (a sort of the gathered
  // rows) costs more per byte than a ring all-reduce. A GPU with NCCL has its own constant:
  // cluster/gpu_session.sh measures it.
  double dense_factor = 0.33;
  std::vector<std::string> names;  // for messages (parallel to the parameters, or empty)
};

// What the last reduce() did, summed over the sparse parameters.
struct SparseReduceStats {
  int64_t rows = 0;          // touched rows: each rank's distinct rows (coalesced locally), summed over ranks
  int64_t sparse_bytes = 0;  // bus bytes of the parameters reduced sparsely (per rank, ring convention)
  int64_t dense_bytes = 0;   // bus bytes of the parameters reduced densely
  int64_t dense_equivalent_bytes = 0;  // what all-reducing every one densely would have moved
  int sparse = 0, densified = 0;       // parameters reduced each way
};

class SparseGradReducer {
 public:
  // params: the parameters whose gradients arrive sparse (each rank the same list).
  SparseGradReducer(std::vector<at::Tensor> params, dist::Communicator& comm, SparseReducerOptions options = {});
  // Averages every parameter's gradient over the communicator (see above). Collective.
  void reduce();
  // A rank that failed before reduce() (out of memory) issues the same collectives with
  // nothing to contribute, so the others finish; the gradients are dropped.
  void abandon();
  // The gradients become undefined (a sparse gradient is replaced, not zeroed).
  void zero_grad();
  const std::vector<at::Tensor>& params() const { return params_; }
  const SparseReduceStats& last_stats() const { return stats_; }

  // The decision rule, for tests and the planner: reduce densely when
  //   gather bus bytes (size - 1) x max_rows x (row_bytes + 8)
  //   > dense_factor x all-reduce bus bytes 2 (size - 1) / size x rows_total x row_bytes.
  static bool choose_dense(int size, int64_t max_rows, int64_t param_rows, int64_t row_bytes, double dense_factor);

 private:
  void reduce_one(size_t i, bool contribute);
  std::vector<at::Tensor> params_;
  dist::Communicator& comm_;
  SparseReducerOptions options_;
  SparseReduceStats stats_;
};

// The parameters of model whose gradients are sparse: the weight of every torch::nn::Embedding
// (or EmbeddingBag) built with sparse(true) and of every VocabParallelEmbedding with sparse on.
// One flag per entry of params (matched by identity).
std::vector<bool> sparse_gradient_flags(torch::nn::Module& model, const std::vector<at::Tensor>& params);

// The elements of a gradient as a dense tensor: itself, or a sparse gradient's values (it is
// coalesced first when it is not). For norms and finiteness checks.
at::Tensor gradient_values(const at::Tensor& grad);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
