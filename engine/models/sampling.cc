#include "dtrain/engine/models/sampling.h"

#include <cmath>
#include <limits>

#include "dtrain/dist/error.h"

namespace dtrain::engine {
namespace {

void check_logits(const at::Tensor& logits) {
  DTRAIN_CHECK(logits.defined() && logits.dim() == 2 && logits.size(0) >= 1 && logits.size(1) >= 1 &&
                   at::isFloatingType(logits.scalar_type()),
               "sampling: logits must be floating-point [B, V] with B, V >= 1, got ",
               logits.defined() ? logits.sizes() : at::IntArrayRef{});
}

// float32 for the half types (softmax and cumulative sums in a precision that sums to 1).
at::Tensor working(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? logits : logits.to(at::kFloat);
}

// Zero outside the nucleus: in each row, the most likely tokens (the lower id first among
// equals) while the mass before them is below top_p; the rest renormalized.
at::Tensor nucleus(const at::Tensor& p, double top_p) {
  auto [sorted, order] = at::sort(p, /*stable=*/true, /*dim=*/1, /*descending=*/true);
  const int64_t V = p.size(1);
  // The mass before each token, summed from the most likely one (a shifted cumulative sum, not
  // cumsum - p: that rounds differently).
  at::Tensor before = at::cat({at::zeros({p.size(0), 1}, p.options()), sorted.cumsum(1).narrow(1, 0, V - 1)}, 1);
  at::Tensor keep_sorted = before < top_p;
  keep_sorted.select(1, 0).fill_(true);
  at::Tensor keep = at::zeros_like(keep_sorted).scatter_(1, order, keep_sorted);
  at::Tensor kept = p.masked_fill(keep.logical_not(), 0);
  return kept / kept.sum(1, /*keepdim=*/true);
}

}  // namespace

void check_sampling_options(const SamplingOptions& o) {
  DTRAIN_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, "sampling: temperature must be >= 0 (0: greedy), "
               "got ", o.temperature);
  DTRAIN_CHECK(o.top_k >= 0, "sampling: top_k must be >= 0 (0: every token), got ", o.top_k);
  DTRAIN_CHECK(o.top_p > 0 && o.top_p <= 1, "sampling: top_p must be in (0, 1] (1: every token), got ", o.top_p);
}

at::Tensor sampling_probabilities(const at::Tensor& logits, const SamplingOptions& o) {
  check_sampling_options(o);
  check_logits(logits);
  at::Tensor x = working(logits);
  if (o.temperature == 0) return at::zeros_like(x).scatter_(1, x.argmax(1, /*keepdim=*/true), 1.0);
  x = x / o.temperature;
  const int64_t V = x.size(1);
  if (o.top_k > 0 && o.top_k < V) {
    at::Tensor keep = at::zeros_like(x, at::kBool).scatter_(1, std::get<1>(x.topk(o.top_k, 1)), true);
    x = x.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
  }
  at::Tensor p = at::softmax(x, 1);
  return o.top_p < 1 ? nucleus(p, o.top_p) : p;
}

at::Tensor sample_next_tokens(const at::Tensor& logits, const SamplingOptions& o, at::Generator& generator) {
  check_sampling_options(o);
  check_logits(logits);
  if (o.temperature == 0) return working(logits).argmax(1).to(at::kCPU);
  DTRAIN_CHECK(generator.device().is_cpu(), "sample_next_tokens: the generator must be a CPU generator, got one of ",
               generator.device());
  at::Tensor p = sampling_probabilities(logits, o).to(at::kCPU);
  DTRAIN_CHECK(p.isfinite().all().item<bool>(), "sample_next_tokens: a row of the logits gives no distribution to draw "
               "from (NaN, +inf, or -inf everywhere)");
  return at::multinomial(p, 1, /*replacement=*/false, generator).squeeze(1);
}

}  // namespace dtrain::engine
