// The fused block operations' autograd functions (fused_block_ops.h): CUDA tensors go to the
// kernels of cuda/fused_block.cu through fused_block_kernels.h; CPU tensors to host loops over
// the same per-element formulas (that header's gelu_tanh, gelu_tanh_grad and
// layer_norm_input_grad), in double for float64 tensors and float otherwise.
// No CUDA header here: the stream is the current one of the tensors' device, through c10.
#include "dtrain/engine/parallel/fused_block_ops.h"

#include <ATen/ATen.h>
#include <ATen/TracerMode.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "fused_block_kernels.h"

namespace dtrain::engine {
namespace detail {

bool add_norm_supported(const AddNormShape& sh) {
#define X(ks, ky, kw, ko, TS, TY, TW, TO) \
  if (sh.s == FbDtype::ks && add_norm_y_key(sh) == FbDtype::ky && sh.w == FbDtype::kw && sh.o == FbDtype::ko) return true;
  DTRAIN_ADD_NORM_CASES(X)
#undef X
  return false;
}

bool bias_gelu_supported(const BiasGeluShape& sh) {
#define X(ky, kb, TY, TB) \
  if (sh.y == FbDtype::ky && sh.b == FbDtype::kb) return true;
  DTRAIN_BIAS_GELU_CASES(X)
#undef X
  return false;
}

// Chunks of about 64 rows (at most 1024) for the column sums' partial results.
int64_t add_norm_workspace_chunks(int64_t rows) { return std::clamp<int64_t>((rows + 63) / 64, 1, 1024); }
int64_t bias_gelu_workspace_chunks(int64_t rows) { return add_norm_workspace_chunks(rows); }

}  // namespace detail
namespace {

using detail::AddNormShape;
using detail::BiasGeluShape;
using detail::FbDtype;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool fb_dtype(at::ScalarType t, FbDtype* out) {
  switch (t) {
    case at::kBFloat16: *out = FbDtype::kBf16; return true;
    case at::kHalf: *out = FbDtype::kFp16; return true;
    case at::kFloat: *out = FbDtype::kFp32; return true;
    case at::kDouble: *out = FbDtype::kFp64; return true;
    default: return false;
  }
}

FbDtype fb_dtype_or_throw(at::ScalarType t) {
  FbDtype d = FbDtype::kFp32;
  DTRAIN_CHECK(fb_dtype(t, &d), "the fused block operations take float64, float32, bfloat16 or float16 tensors, not ", t);
  return d;
}

// The accumulation type of a sum of dtype s: double for float64, else float.
at::ScalarType fb_acc_of(at::ScalarType s) { return s == at::kDouble ? at::kDouble : at::kFloat; }

void* fb_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(device).native_handle();
}

void fb_check(const char* error, const char* what) {
  DTRAIN_CHECK(error == nullptr, "the fused ", what, " kernel failed: ", error);
}

const void* fb_ptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }
void* fb_mut(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

void check_add_norm_inputs(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias) {
  DTRAIN_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) >= 1, "the fused LayerNorm takes x [..., D] with D >= 1, got ",
               x.defined() ? x.sizes() : at::IntArrayRef{});
  const int64_t d = x.size(-1);
  DTRAIN_CHECK(weight.defined() && weight.dim() == 1 && weight.size(0) == d,
               "the fused LayerNorm's weight must be [", d, "] (the last dimension of x ", x.sizes(), "), got ",
               weight.defined() ? weight.sizes() : at::IntArrayRef{});
  DTRAIN_CHECK(!bias.defined() || (bias.sizes() == weight.sizes() && bias.scalar_type() == weight.scalar_type()),
               "the fused LayerNorm's bias must match its weight (", weight.sizes(), ", ", weight.scalar_type(),
               "), got ", bias.sizes(), ", ", bias.scalar_type());
  DTRAIN_CHECK(!y.defined() || y.sizes() == x.sizes(), "the fused LayerNorm adds y of x's shape ", x.sizes(),
               ", got ", y.defined() ? y.sizes() : at::IntArrayRef{}, " (broadcasting is not supported)");
  for (const at::Tensor* t : {&y, &weight, &bias}) {
    DTRAIN_CHECK(!t->defined() || t->device() == x.device(), "the fused LayerNorm's tensors must share x's device (",
                 x.device(), "), got one on ", t->device());
  }
}

// The kernels' description of a norm over rows of `sum` (the sum's dtype s; y's dtype when
// there is a y), the weight's dtype w and the output's o.
AddNormShape add_norm_shape(const at::Tensor& sum, at::ScalarType s, std::optional<at::ScalarType> y,
                            at::ScalarType w, at::ScalarType o, bool rms) {
  AddNormShape sh;
  sh.cols = sum.size(-1);
  sh.rows = sum.numel() / sh.cols;
  sh.s = fb_dtype_or_throw(s);
  sh.has_y = y.has_value();
  sh.y = y ? fb_dtype_or_throw(*y) : sh.s;
  sh.w = fb_dtype_or_throw(w);
  sh.o = fb_dtype_or_throw(o);
  sh.rms = rms;
  return sh;
}

AddNormShape add_norm_shape(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, at::ScalarType out,
                            bool rms = false) {
  return add_norm_shape(x, y.defined() ? at::promote_types(x.scalar_type(), y.scalar_type()) : x.scalar_type(),
                        y.defined() ? std::optional<at::ScalarType>(y.scalar_type()) : std::nullopt,
                        weight.scalar_type(), out, rms);
}

// ---- the host path: the kernels' formulas in loops ------------------------------------------

// Forward on the host, per row: the mean (0 for an RMSNorm), the mean square about it, and
// xhat = (s - mean) * rstd, all in A. The caller rounds xhat (RMSNorm) and applies the weight.
template <class A>
void add_norm_forward_host(const at::Tensor& s_acc, double eps, bool rms, at::Tensor& xhat_acc, at::Tensor& mean,
                           at::Tensor& rstd) {
  const int64_t cols = s_acc.size(-1), rows = s_acc.numel() / cols;
  const A* s = s_acc.const_data_ptr<A>();
  A* xh = xhat_acc.data_ptr<A>();
  A* mu = mean.data_ptr<A>();
  A* rs = rstd.data_ptr<A>();
  for (int64_t r = 0; r < rows; ++r) {
    const A* row = s + r * cols;
    A total = 0;
    if (!rms) {
      for (int64_t c = 0; c < cols; ++c) total += row[c];
    }
    const A m = total / static_cast<A>(cols);
    A sq = 0;
    for (int64_t c = 0; c < cols; ++c) sq += (row[c] - m) * (row[c] - m);
    const A inv = A(1) / std::sqrt(sq / static_cast<A>(cols) + static_cast<A>(eps));
    for (int64_t c = 0; c < cols; ++c) xh[r * cols + c] = (row[c] - m) * inv;
    mu[r] = m;
    rs[r] = inv;
  }
}

// Backward on the host: ds, the norm's input gradient (layer_norm_input_grad, without the mean
// term for an RMSNorm) plus grad_sum, in A.
template <class A>
void add_norm_backward_host(const at::Tensor& dn_acc, const at::Tensor& gs_acc, const at::Tensor& s_acc,
                            const at::Tensor& w_acc, const at::Tensor& mean, const at::Tensor& rstd, bool rms,
                            at::Tensor& ds_acc) {
  const int64_t cols = s_acc.size(-1), rows = s_acc.numel() / cols;
  const A* dn = dn_acc.const_data_ptr<A>();
  const A* gs = gs_acc.defined() ? gs_acc.const_data_ptr<A>() : nullptr;
  const A* s = s_acc.const_data_ptr<A>();
  const A* w = w_acc.const_data_ptr<A>();
  const A* mu = mean.const_data_ptr<A>();
  const A* rs = rstd.const_data_ptr<A>();
  A* ds = ds_acc.data_ptr<A>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * cols;
    A a = 0, bsum = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const A xhat = (s[base + c] - mu[r]) * rs[r];
      const A g = dn[base + c] * w[c];
      a += g;
      bsum += g * xhat;
    }
    a = rms ? A(0) : a / static_cast<A>(cols);
    bsum /= static_cast<A>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const A xhat = (s[base + c] - mu[r]) * rs[r];
      ds[base + c] = detail::layer_norm_input_grad<A>(dn[base + c] * w[c], xhat, rs[r], a, bsum) +
                     (gs ? gs[base + c] : A(0));
    }
  }
}

template <class A>
void swiglu_forward_host(const at::Tensor& g_acc, const at::Tensor& u_acc, at::Tensor& out_acc) {
  const A* g = g_acc.const_data_ptr<A>();
  const A* u = u_acc.const_data_ptr<A>();
  A* o = out_acc.data_ptr<A>();
  for (int64_t i = 0; i < g_acc.numel(); ++i) o[i] = detail::silu<A>(g[i]) * u[i];
}

template <class A>
void swiglu_backward_host(const at::Tensor& d_acc, const at::Tensor& g_acc, const at::Tensor& u_acc,
                          at::Tensor& dg_acc, at::Tensor& du_acc) {
  const A* d = d_acc.const_data_ptr<A>();
  const A* g = g_acc.const_data_ptr<A>();
  const A* u = u_acc.const_data_ptr<A>();
  A* dg = dg_acc.data_ptr<A>();
  A* du = du_acc.data_ptr<A>();
  for (int64_t i = 0; i < g_acc.numel(); ++i) {
    dg[i] = d[i] * u[i] * detail::silu_grad<A>(g[i]);
    du[i] = d[i] * detail::silu<A>(g[i]);
  }
}

template <class A>
void bias_gelu_forward_host(const at::Tensor& y_acc, const at::Tensor& b_acc, at::Tensor& out_acc) {
  const int64_t cols = y_acc.size(-1), n = y_acc.numel();
  const A* y = y_acc.const_data_ptr<A>();
  const A* b = b_acc.const_data_ptr<A>();
  A* o = out_acc.data_ptr<A>();
  for (int64_t i = 0; i < n; ++i) o[i] = detail::gelu_tanh<A>(y[i] + b[i % cols]);
}

template <class A>
void bias_gelu_backward_host(const at::Tensor& g_acc, const at::Tensor& y_acc, const at::Tensor& b_acc,
                             at::Tensor& gy_acc) {
  const int64_t cols = y_acc.size(-1), n = y_acc.numel();
  const A* g = g_acc.const_data_ptr<A>();
  const A* y = y_acc.const_data_ptr<A>();
  const A* b = b_acc.const_data_ptr<A>();
  A* gy = gy_acc.data_ptr<A>();
  for (int64_t i = 0; i < n; ++i) gy[i] = g[i] * detail::gelu_tanh_grad<A>(y[i] + b[i % cols]);
}

// Column sums of a [rows, cols] host tensor, row after row (the kernels' order within a chunk
// differs; sums agree to rounding).
template <class A>
at::Tensor column_sums_host(const at::Tensor& t) {
  const int64_t cols = t.size(-1), rows = t.numel() / cols;
  at::Tensor out = at::zeros({cols}, t.options());
  const A* p = t.const_data_ptr<A>();
  A* o = out.data_ptr<A>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) o[c] += p[r * cols + c];
  return out;
}

at::Tensor fb_host(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

// ---- the autograd functions ---------------------------------------------------------------

// xhat for the weight: (s - mean) * rstd, rounded to s's dtype for an RMSNorm (host path).
at::Tensor host_xhat_for_weight(const at::Tensor& s_acc, const at::Tensor& mean, const at::Tensor& rstd, bool rms,
                                at::ScalarType s_type) {
  const int64_t cols = s_acc.size(-1);
  at::Tensor xhat = (s_acc.reshape({-1, cols}) - mean.unsqueeze(1)) * rstd.unsqueeze(1);
  return rms ? xhat.to(s_type).to(s_acc.scalar_type()) : xhat;
}

struct FusedAddNormFn : torch::autograd::Function<FusedAddNormFn> {
  // Returns {normed} without y, {sum, normed} with it. rms: an RMSNorm (fused_block_kernels.h).
  // y and bias as optionals: autograd takes an undefined at::Tensor for an input it must
  // describe (its device, its dtype), an empty optional for a non-input.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x_in, const std::optional<at::Tensor>& y_opt,
                               const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_opt, double eps,
                               int64_t out_dtype, bool rms) {
    // An output nothing used (the sum of a post-norm sublayer, whose next residual is the norm)
    // reaches backward undefined instead of as a tensor of zeros the kernel would read.
    ctx->set_materialize_grads(false);
    const at::Tensor y_in = y_opt.value_or(at::Tensor()), bias_in = bias_opt.value_or(at::Tensor());
    const c10::DeviceGuard guard(x_in.device());
    const at::Tensor y = y_in.defined() ? y_in.contiguous() : y_in;
    const at::ScalarType s_type =
        y.defined() ? at::promote_types(x_in.scalar_type(), y.scalar_type()) : x_in.scalar_type();
    const at::Tensor x = x_in.to(s_type).contiguous();  // the kernels read x in the sum's dtype
    const at::Tensor weight = weight_in.contiguous();
    const at::Tensor bias = bias_in.defined() ? bias_in.contiguous() : bias_in;
    const auto out_type = static_cast<at::ScalarType>(out_dtype);
    const at::ScalarType acc = fb_acc_of(s_type);
    const int64_t cols = x.size(-1), rows = x.numel() / cols;
    const char* what = rms ? "RMSNorm" : "LayerNorm";
    at::Tensor sum, out, mean, rstd;
    if (x.is_cuda()) {
      const AddNormShape sh = add_norm_shape(x, y, weight, out_type, rms);
      DTRAIN_CHECK(detail::add_norm_supported(sh) && detail::fused_block_kernels_built(), "the fused ", what,
                   " has no CUDA kernel for x ", x.scalar_type(), ", y ", y.defined() ? y.scalar_type() : x.scalar_type(),
                   ", weight ", weight.scalar_type(), " into ", out_type,
                   " in this build (see fused_add_layer_norm_available)");
      sum = y.defined() ? at::empty(x.sizes(), x.options().dtype(s_type)) : at::Tensor();
      out = at::empty(x.sizes(), x.options().dtype(out_type));
      mean = at::empty({rows}, x.options().dtype(acc));
      rstd = at::empty({rows}, x.options().dtype(acc));
      fb_check(detail::add_norm_forward(sh, x.const_data_ptr(), fb_ptr(y), weight.const_data_ptr(), fb_ptr(bias), eps,
                                        fb_mut(sum), out.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
                                        fb_stream(x.device())),
               what);
    } else {
      DTRAIN_CHECK(x.is_cpu(), "the fused ", what, " runs on CUDA or the CPU, not ", x.device());
      at::Tensor s_acc = fb_host(x, acc);
      if (y.defined()) {
        sum = (s_acc + y.to(acc)).to(s_type);  // rounded to the sum's dtype, as the kernels do
        s_acc = fb_host(sum, acc);
      }
      at::Tensor xhat = at::empty(x.sizes(), x.options().dtype(acc));
      mean = at::empty({rows}, x.options().dtype(acc));
      rstd = at::empty({rows}, x.options().dtype(acc));
      if (acc == at::kDouble) {
        add_norm_forward_host<double>(s_acc, eps, rms, xhat, mean, rstd);
      } else {
        add_norm_forward_host<float>(s_acc, eps, rms, xhat, mean, rstd);
      }
      if (rms) xhat = xhat.to(s_type).to(acc);  // Llama's cast back to the input's dtype
      at::Tensor out_acc = xhat * fb_host(weight, acc);
      if (bias.defined()) out_acc = out_acc + fb_host(bias, acc);
      out = out_acc.to(out_type);
    }
    const at::Tensor saved_s = y.defined() ? sum : x;  // the sum's dtype either way
    ctx->save_for_backward({saved_s, weight, mean, rstd});
    ctx->saved_data["has_y"] = y.defined();
    ctx->saved_data["y_dtype"] = static_cast<int64_t>(y.defined() ? y.scalar_type() : s_type);
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x_in.scalar_type());
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["out_dtype"] = out_dtype;
    ctx->saved_data["rms"] = rms;
    if (y.defined()) return {sum, out};
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& s = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& rstd = saved[3];
    const c10::DeviceGuard guard(s.device());
    const bool has_y = ctx->saved_data["has_y"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool rms = ctx->saved_data["rms"].toBool();
    const auto y_type = static_cast<at::ScalarType>(ctx->saved_data["y_dtype"].toInt());
    const auto x_type = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto out_type = static_cast<at::ScalarType>(ctx->saved_data["out_dtype"].toInt());
    const at::ScalarType acc = fb_acc_of(s.scalar_type());
    const variable_list none(7);
    const at::Tensor gs = has_y && grads[0].defined() ? grads[0].to(s.scalar_type()).contiguous() : at::Tensor();
    at::Tensor dn = grads[has_y ? 1 : 0];
    // Nothing reached the output: the sum's gradient passes through, the weights get none.
    if (!dn.defined()) {
      if (!gs.defined()) return none;
      variable_list r = none;
      r[0] = gs.to(x_type);
      if (has_y) r[1] = gs.to(y_type);
      return r;
    }
    dn = dn.to(out_type).contiguous();
    const int64_t cols = s.size(-1), rows = s.numel() / cols;
    at::Tensor gx, gy, gw, gb;
    if (s.is_cuda()) {
      const AddNormShape sh =
          add_norm_shape(s, s.scalar_type(), has_y ? std::optional<at::ScalarType>(y_type) : std::nullopt,
                         weight.scalar_type(), out_type, rms);
      gx = at::empty(s.sizes(), s.options());
      gy = has_y ? at::empty(s.sizes(), s.options().dtype(y_type)) : at::Tensor();
      // No rows: the kernels return at once, so the weight gradients must start at zero.
      gw = rows == 0 ? at::zeros_like(weight) : at::empty_like(weight);
      gb = !has_bias ? at::Tensor() : rows == 0 ? at::zeros_like(weight) : at::empty_like(weight);
      at::Tensor workspace = at::empty({2 * detail::add_norm_workspace_chunks(rows) * cols}, s.options().dtype(acc));
      fb_check(detail::add_norm_backward(sh, dn.const_data_ptr(), fb_ptr(gs), s.const_data_ptr(),
                                         weight.const_data_ptr(), mean.const_data_ptr(), rstd.const_data_ptr(),
                                         gx.data_ptr(), fb_mut(gy), gw.data_ptr(), fb_mut(gb), workspace.data_ptr(),
                                         fb_stream(s.device())),
               rms ? "RMSNorm backward" : "LayerNorm backward");
    } else {
      at::Tensor ds = at::empty(s.sizes(), s.options().dtype(acc));
      const at::Tensor gs_acc = gs.defined() ? fb_host(gs, acc) : gs;
      const at::Tensor dn_acc = fb_host(dn, acc), s_acc = fb_host(s, acc);
      if (acc == at::kDouble) {
        add_norm_backward_host<double>(dn_acc, gs_acc, s_acc, fb_host(weight, acc), mean, rstd, rms, ds);
      } else {
        add_norm_backward_host<float>(dn_acc, gs_acc, s_acc, fb_host(weight, acc), mean, rstd, rms, ds);
      }
      gx = ds.to(s.scalar_type());
      gy = has_y ? gx.to(y_type) : at::Tensor();
      const at::Tensor dn_rows = dn_acc.reshape({-1, cols});
      gw = (dn_rows * host_xhat_for_weight(s_acc, mean, rstd, rms, s.scalar_type())).sum(0).to(weight.scalar_type());
      gb = has_bias ? dn_rows.sum(0).to(weight.scalar_type()) : at::Tensor();
    }
    // x's gradient in x's dtype (the sum's dtype is x's unless y promoted it).
    if (gx.scalar_type() != x_type) gx = gx.to(x_type);
    return {gx, gy, gw, gb, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct FusedSwigluFn : torch::autograd::Function<FusedSwigluFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_in, const at::Tensor& up_in) {
    const c10::DeviceGuard guard(gate_in.device());
    const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
    at::Tensor out;
    if (gate.is_cuda()) {
      out = at::empty_like(gate);
      fb_check(detail::swiglu_forward(gate.numel(), fb_dtype_or_throw(gate.scalar_type()), gate.const_data_ptr(),
                                      up.const_data_ptr(), out.data_ptr(), fb_stream(gate.device())),
               "SwiGLU forward");
    } else {
      DTRAIN_CHECK(gate.is_cpu(), "the fused SwiGLU runs on CUDA or the CPU, not ", gate.device());
      const at::ScalarType acc = fb_acc_of(gate.scalar_type());
      at::Tensor out_acc = at::empty(gate.sizes(), gate.options().dtype(acc));
      if (acc == at::kDouble) {
        swiglu_forward_host<double>(fb_host(gate, acc), fb_host(up, acc), out_acc);
      } else {
        swiglu_forward_host<float>(fb_host(gate, acc), fb_host(up, acc), out_acc);
      }
      out = out_acc.to(gate.scalar_type());
    }
    ctx->save_for_backward({gate, up});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& gate = saved[0];
    const at::Tensor& up = saved[1];
    const c10::DeviceGuard guard(gate.device());
    const at::Tensor d = grads[0].to(gate.scalar_type()).contiguous();
    at::Tensor dg, du;
    if (gate.is_cuda()) {
      dg = at::empty_like(gate);
      du = at::empty_like(up);
      fb_check(detail::swiglu_backward(gate.numel(), fb_dtype_or_throw(gate.scalar_type()), d.const_data_ptr(),
                                       gate.const_data_ptr(), up.const_data_ptr(), dg.data_ptr(), du.data_ptr(),
                                       fb_stream(gate.device())),
               "SwiGLU backward");
    } else {
      const at::ScalarType acc = fb_acc_of(gate.scalar_type());
      at::Tensor dg_acc = at::empty(gate.sizes(), gate.options().dtype(acc)), du_acc = at::empty_like(dg_acc);
      if (acc == at::kDouble) {
        swiglu_backward_host<double>(fb_host(d, acc), fb_host(gate, acc), fb_host(up, acc), dg_acc, du_acc);
      } else {
        swiglu_backward_host<float>(fb_host(d, acc), fb_host(gate, acc), fb_host(up, acc), dg_acc, du_acc);
      }
      dg = dg_acc.to(gate.scalar_type());
      du = du_acc.to(up.scalar_type());
    }
    return {dg, du};
  }
};

struct FusedBiasGeluFn : torch::autograd::Function<FusedBiasGeluFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y_in, const at::Tensor& bias_in) {
    const c10::DeviceGuard guard(y_in.device());
    const at::Tensor y = y_in.contiguous(), bias = bias_in.contiguous();
    at::Tensor out;
    if (y.is_cuda()) {
      const BiasGeluShape sh{y.numel() / y.size(-1), y.size(-1), fb_dtype_or_throw(y.scalar_type()),
                             fb_dtype_or_throw(bias.scalar_type())};
      DTRAIN_CHECK(detail::bias_gelu_supported(sh) && detail::fused_block_kernels_built(),
                   "the fused bias + GELU has no CUDA kernel for y ", y.scalar_type(), " with a ", bias.scalar_type(),
                   " bias in this build (see fused_bias_gelu_available)");
      out = at::empty_like(y);
      fb_check(detail::bias_gelu_forward(sh, y.const_data_ptr(), bias.const_data_ptr(), out.data_ptr(),
                                             fb_stream(y.device())),
                   "bias + GELU forward");
    } else {
      DTRAIN_CHECK(y.is_cpu(), "the fused bias + GELU runs on CUDA or the CPU, not ", y.device());
      const at::ScalarType acc = fb_acc_of(y.scalar_type());
      at::Tensor out_acc = at::empty(y.sizes(), y.options().dtype(acc));
      if (acc == at::kDouble) {
        bias_gelu_forward_host<double>(fb_host(y, acc), fb_host(bias, acc), out_acc);
      } else {
        bias_gelu_forward_host<float>(fb_host(y, acc), fb_host(bias, acc), out_acc);
      }
      out = out_acc.to(y.scalar_type());
    }
    ctx->save_for_backward({y, bias});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& y = saved[0];
    const at::Tensor& bias = saved[1];
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const c10::DeviceGuard guard(y.device());
    const at::Tensor g = grads[0].to(y.scalar_type()).contiguous();
    const int64_t cols = y.size(-1), rows = y.numel() / cols;
    at::Tensor gy, gb;
    if (y.is_cuda()) {
      const BiasGeluShape sh{rows, cols, fb_dtype_or_throw(y.scalar_type()), fb_dtype_or_throw(bias.scalar_type())};
      gy = at::empty_like(y);
      gb = at::empty_like(bias);
      at::Tensor workspace =
          at::empty({detail::bias_gelu_workspace_chunks(rows) * cols}, y.options().dtype(fb_acc_of(y.scalar_type())));
      fb_check(detail::bias_gelu_backward(sh, g.const_data_ptr(), y.const_data_ptr(), bias.const_data_ptr(),
                                              gy.data_ptr(), gb.data_ptr(), workspace.data_ptr(),
                                              fb_stream(y.device())),
                   "bias + GELU backward");
    } else {
      const at::ScalarType acc = fb_acc_of(y.scalar_type());
      at::Tensor gy_acc = at::empty(y.sizes(), y.options().dtype(acc));
      if (acc == at::kDouble) {
        bias_gelu_backward_host<double>(fb_host(g, acc), fb_host(y, acc), fb_host(bias, acc), gy_acc);
      } else {
        bias_gelu_backward_host<float>(fb_host(g, acc), fb_host(y, acc), fb_host(bias, acc), gy_acc);
      }
      gy = gy_acc.to(y.scalar_type());
      // The bias gradient sums the rounded input gradient, as the kernel does.
      const at::Tensor rounded = fb_host(gy, acc);
      gb = (acc == at::kDouble ? column_sums_host<double>(rounded) : column_sums_host<float>(rounded))
               .to(bias.scalar_type());
    }
    return {gy, gb};
  }
};

}  // namespace

bool fused_add_layer_norm_available(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                    const at::Tensor& bias, at::ScalarType out_dtype) {
  if (!x.defined() || !x.is_cuda() || !detail::fused_block_kernels_built() || x.dim() < 1 || x.size(-1) < 1) {
    return false;
  }
  if (!weight.defined() || weight.dim() != 1 || weight.size(0) != x.size(-1) || weight.device() != x.device()) {
    return false;
  }
  if (bias.defined() && (bias.sizes() != weight.sizes() || bias.scalar_type() != weight.scalar_type() ||
                         bias.device() != x.device())) {
    return false;
  }
  if (y.defined() && (y.sizes() != x.sizes() || y.device() != x.device())) return false;
  FbDtype tmp = FbDtype::kFp32;
  for (const at::Tensor* t : {&x, &y, &weight}) {
    if (t->defined() && !fb_dtype(t->scalar_type(), &tmp)) return false;
  }
  if (!fb_dtype(out_dtype, &tmp)) return false;
  if (y.defined() && !fb_dtype(at::promote_types(x.scalar_type(), y.scalar_type()), &tmp)) return false;
  return detail::add_norm_supported(add_norm_shape(x, y, weight, out_dtype));
}

bool fused_bias_gelu_available(const at::Tensor& y, const at::Tensor& bias) {
  if (!y.defined() || !bias.defined() || !y.is_cuda() || !detail::fused_block_kernels_built()) return false;
  if (y.dim() < 1 || bias.dim() != 1 || bias.size(0) != y.size(-1) || bias.device() != y.device()) return false;
  BiasGeluShape sh;
  sh.rows = y.numel() / std::max<int64_t>(y.size(-1), 1);
  sh.cols = y.size(-1);
  return fb_dtype(y.scalar_type(), &sh.y) && fb_dtype(bias.scalar_type(), &sh.b) && detail::bias_gelu_supported(sh);
}

AddLayerNorm fused_add_layer_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                  const at::Tensor& bias, double eps, std::optional<at::ScalarType> out_dtype) {
  check_add_norm_inputs(x, y, weight, bias);
  const at::ScalarType s_type = y.defined() ? at::promote_types(x.scalar_type(), y.scalar_type()) : x.scalar_type();
  const at::ScalarType out = out_dtype.value_or(s_type);
  const std::optional<at::Tensor> y_opt = y.defined() ? std::optional<at::Tensor>(y) : std::nullopt;
  const std::optional<at::Tensor> b_opt = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  const variable_list r = FusedAddNormFn::apply(x, y_opt, weight, b_opt, eps, static_cast<int64_t>(out), false);
  if (y.defined()) return {r[0], r[1]};
  return {x, r[0]};
}

AddLayerNorm fused_add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, double eps,
                                std::optional<at::ScalarType> out_dtype) {
  check_add_norm_inputs(x, y, weight, at::Tensor());
  const at::ScalarType s_type = y.defined() ? at::promote_types(x.scalar_type(), y.scalar_type()) : x.scalar_type();
  const at::ScalarType out = out_dtype.value_or(at::promote_types(s_type, weight.scalar_type()));
  const std::optional<at::Tensor> y_opt = y.defined() ? std::optional<at::Tensor>(y) : std::nullopt;
  const variable_list r =
      FusedAddNormFn::apply(x, y_opt, weight, std::optional<at::Tensor>(), eps, static_cast<int64_t>(out), true);
  if (y.defined()) return {r[0], r[1]};
  return {x, r[0]};
}

at::Tensor fused_swiglu(const at::Tensor& gate, const at::Tensor& up) {
  DTRAIN_CHECK(gate.defined() && up.defined() && gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() &&
                   gate.device() == up.device(),
               "the fused SwiGLU takes gate and up of one shape, dtype and device, got ",
               gate.defined() ? gate.sizes() : at::IntArrayRef{}, " ", gate.defined() ? gate.scalar_type() : at::kFloat,
               " and ", up.defined() ? up.sizes() : at::IntArrayRef{}, " ", up.defined() ? up.scalar_type() : at::kFloat);
  return FusedSwigluFn::apply(gate, up);
}

at::Tensor fused_bias_gelu(const at::Tensor& y, const at::Tensor& bias) {
  DTRAIN_CHECK(y.defined() && bias.defined() && y.dim() >= 1 && bias.dim() == 1 && bias.size(0) == y.size(-1),
               "the fused bias + GELU takes y [..., F] and bias [F], got ", y.defined() ? y.sizes() : at::IntArrayRef{},
               " and ", bias.defined() ? bias.sizes() : at::IntArrayRef{});
  DTRAIN_CHECK(bias.device() == y.device(), "the fused bias + GELU's bias must be on y's device (", y.device(),
               "), got ", bias.device());
  if (y.numel() == 0) return at::gelu(y + bias, "tanh");  // nothing to fuse (and no row width to divide by)
  return FusedBiasGeluFn::apply(y, bias);
}

namespace {
// -1: as the environment says; 0 or 1: set_fused_block_ops' override.
std::atomic<int> fused_override{-1};
}  // namespace

bool fused_block_ops_enabled() {
  const int o = fused_override.load(std::memory_order_relaxed);
  if (o >= 0) return o == 1;
  // Read once. Off unless DTRAIN_FUSED_BLOCK_OPS=1 until the GPU suite has run the kernels.
  static const bool from_env = [] {
    const char* v = std::getenv("DTRAIN_FUSED_BLOCK_OPS");
    if (v == nullptr || *v == '\0') return kFusedBlockOpsByDefault;
    const std::string s(v);
    DTRAIN_CHECK(s == "0" || s == "1", "DTRAIN_FUSED_BLOCK_OPS=", s, ": use 1 (dtrain's fused block kernels on CUDA) "
                 "or 0 (ATen's ops)");
    return s == "1";
  }();
  return from_env;
}

void set_fused_block_ops(std::optional<bool> enabled) {
  fused_override.store(enabled ? (*enabled ? 1 : 0) : -1, std::memory_order_relaxed);
}

bool fused_block_kernels_serve(const at::Tensor& x) {
  // Not while TorchScript traces (dtrain-export): the tracer records ATen's ops, not raw kernels.
  return x.defined() && x.is_cuda() && detail::fused_block_kernels_built() && fused_block_ops_enabled() &&
         !at::tracer::impl::is_dispatch_enabled();
}

namespace {
// The dtype of a norm whose output feeds a Linear: under autocast the Linear casts a float32 norm
// to autocast's dtype, so the kernel rounds to it directly (the same single rounding); else
// `plain`.
at::ScalarType norm_output_for_linear(const at::Tensor& x, at::ScalarType plain) {
  if (at::autocast::is_autocast_enabled(x.device().type()) && plain == at::kFloat) {
    return at::autocast::get_autocast_dtype(x.device().type());
  }
  return plain;
}

at::ScalarType sum_type(const at::Tensor& x, const at::Tensor& y) {
  return y.defined() ? at::promote_types(x.scalar_type(), y.scalar_type()) : x.scalar_type();
}
}  // namespace

AddLayerNorm add_layer_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                            double eps) {
  if (fused_block_kernels_serve(x)) {
    const at::ScalarType out = norm_output_for_linear(x, sum_type(x, y));
    if (fused_add_layer_norm_available(x, y, weight, bias, out)) return fused_add_layer_norm(x, y, weight, bias, eps, out);
  }
  at::Tensor s = y.defined() ? x + y : x;
  return {s, at::layer_norm(s, {s.size(-1)}, weight, bias, eps)};
}

AddLayerNorm add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, double eps) {
  if (fused_block_kernels_serve(x) && weight.defined()) {
    const at::ScalarType out = norm_output_for_linear(x, at::promote_types(sum_type(x, y), weight.scalar_type()));
    if (fused_add_layer_norm_available(x, y, weight, at::Tensor(), out)) return fused_add_rms_norm(x, y, weight, eps, out);
  }
  at::Tensor s = y.defined() ? x + y : x;
  // transformers' LlamaRMSNorm, op for op: float32, then the input's dtype, then the weight.
  at::Tensor h = s.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return {s, weight * h.to(s.scalar_type())};
}

bool fused_swiglu_available(const at::Tensor& gate, const at::Tensor& up) {
  FbDtype tmp = FbDtype::kFp32;
  return gate.defined() && up.defined() && gate.is_cuda() && detail::fused_block_kernels_built() &&
         gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() && gate.device() == up.device() &&
         fb_dtype(gate.scalar_type(), &tmp);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (fused_block_ops_enabled() && fused_swiglu_available(gate, up)) return fused_swiglu(gate, up);
  return at::silu(gate) * up;
}

at::Tensor bias_gelu(const at::Tensor& y, const at::Tensor& bias) {
  if (fused_block_ops_enabled() && fused_bias_gelu_available(y, bias)) return fused_bias_gelu(y, bias);
  return at::gelu(y + bias, "tanh");
}

}  // namespace dtrain::engine
