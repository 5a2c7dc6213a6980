#include "dtrain/engine/parallel/sparse_reducer.h"

#include <algorithm>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/modules.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine {

at::Tensor gradient_values(const at::Tensor& grad) {
  if (!grad.defined() || !grad.is_sparse()) return grad;
  return grad.is_coalesced() ? grad._values() : grad.coalesce()._values();
}

std::vector<bool> sparse_gradient_flags(torch::nn::Module& model, const std::vector<at::Tensor>& params) {
  std::unordered_map<const void*, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index[params[i].unsafeGetTensorImpl()] = i;
  std::vector<bool> flags(params.size(), false);
  auto flag = [&](const at::Tensor& w) {
    auto it = w.defined() ? index.find(w.unsafeGetTensorImpl()) : index.end();
    if (it != index.end()) flags[it->second] = true;
  };
  for_each_module(model, [&](const std::string&, torch::nn::Module& m) {
    if (auto* e = m.as<torch::nn::EmbeddingImpl>(); e && e->options.sparse()) flag(e->weight);
    if (auto* e = m.as<torch::nn::EmbeddingBagImpl>(); e && e->options.sparse()) flag(e->weight);
    if (auto* e = m.as<VocabParallelEmbeddingImpl>(); e && e->sparse) flag(e->weight);
  });
  return flags;
}

SparseGradReducer::SparseGradReducer(std::vector<at::Tensor> params, dist::Communicator& comm,
                                     SparseReducerOptions options)
    : params_(std::move(params)), comm_(comm), options_(std::move(options)) {
  DTRAIN_CHECK(options_.dense_factor > 0, "SparseReducerOptions::dense_factor must be > 0, got ",
               options_.dense_factor);
  for (size_t i = 0; i < params_.size(); ++i) {
    DTRAIN_CHECK(params_[i].dim() >= 1, "a sparse gradient needs a parameter with rows; parameter ", i,
                 " has shape ", params_[i].sizes());
  }
}

bool SparseGradReducer::choose_dense(int size, int64_t max_rows, int64_t param_rows, int64_t row_bytes,
                                     double dense_factor) {
  if (size <= 1) return false;
  const double gather = static_cast<double>(size - 1) * max_rows * (row_bytes + 8);
  const double all_reduce = 2.0 * (size - 1) / size * param_rows * row_bytes;
  return gather > dense_factor * all_reduce;
}

void SparseGradReducer::reduce_one(size_t i, bool contribute) {
  at::Tensor& p = params_[i];
  at::Tensor g = contribute ? p.grad() : at::Tensor();
  const int n = comm_.size();
  const int64_t rows_total = p.size(0);
  const int64_t row_numel = p.numel() / std::max<int64_t>(rows_total, 1);
  const int64_t row_bytes = row_numel * static_cast<int64_t>(p.element_size());
  at::NoGradGuard no_grad;
  // A gradient already dense on this rank (a model that does not produce sparse rows) counts as
  // every row touched, so every rank chooses the dense path for it.
  if (g.defined() && g.is_sparse()) g = g.coalesce();
  const int64_t mine = !g.defined() ? 0 : g.is_sparse() ? g._nnz() : rows_total;
  const at::Tensor index = g.defined() && g.is_sparse() ? g._indices().reshape({-1}) :
                           g.defined() ? at::arange(rows_total, p.options().dtype(at::kLong))
                                       : at::empty({0}, p.options().dtype(at::kLong));
  // The counts travel first (one int64 per rank); the choice follows from them everywhere, and
  // the row gathers below reuse them.
  const std::vector<int64_t> counts = dist::all_gather_counts(comm_, mine, p.device());
  const int64_t biggest = *std::max_element(counts.begin(), counts.end());
  int64_t touched = 0;
  for (int64_t c : counts) touched += c;
  stats_.rows += touched;
  stats_.dense_equivalent_bytes += static_cast<int64_t>(2.0 * (n - 1) / n * rows_total * row_bytes);
  if (choose_dense(n, biggest, rows_total, row_bytes, options_.dense_factor)) {
    at::Tensor dense = !g.defined() ? at::zeros_like(p) : g.is_sparse() ? g.to_dense() : g.contiguous();
    comm_.all_reduce(dense, dist::ReduceOp::kAvg)->wait();
    if (contribute) p.mutable_grad() = dense;
    stats_.dense_bytes += static_cast<int64_t>(2.0 * (n - 1) / n * rows_total * row_bytes);
    ++stats_.densified;
    return;
  }
  ++stats_.sparse;
  if (n == 1) {
    if (g.defined()) p.mutable_grad() = g;
    return;
  }
  // Sparse: gather the indices and the rows (padded to the largest count), sum duplicates.
  at::Tensor values = !g.defined() ? at::empty({0, row_numel}, p.options())
                      : g.is_sparse() ? g._values().reshape({mine, row_numel}) : g.reshape({rows_total, row_numel});
  at::Tensor all_index = dist::all_gather_rows(comm_, index.contiguous(), counts);
  at::Tensor all_values = dist::all_gather_rows(comm_, values.contiguous(), counts);
  stats_.sparse_bytes += static_cast<int64_t>(n - 1) * biggest * (row_bytes + 8);
  if (!contribute) return;
  std::vector<int64_t> shape = p.sizes().vec();
  std::vector<int64_t> value_shape = shape;
  value_shape[0] = all_values.size(0);
  at::Tensor summed = at::sparse_coo_tensor(all_index.unsqueeze(0), all_values.reshape(value_shape), shape,
                                            p.options().layout(at::kSparse))
                          .coalesce();
  summed._values().div_(n);  // the average, still coalesced
  p.mutable_grad() = summed;
}

void SparseGradReducer::reduce() {
  stats_ = SparseReduceStats();
  for (size_t i = 0; i < params_.size(); ++i) reduce_one(i, /*contribute=*/true);
}

void SparseGradReducer::abandon() {
  stats_ = SparseReduceStats();
  for (size_t i = 0; i < params_.size(); ++i) reduce_one(i, /*contribute=*/false);
  zero_grad();
}

void SparseGradReducer::zero_grad() {
  for (at::Tensor& p : params_) p.mutable_grad().reset();
}

}  // namespace dtrain::engine
