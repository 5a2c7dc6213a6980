#include "dtrain/engine/models/seq2seq.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/activation_checkpoint.h"
#include "dtrain/engine/parallel/cross_entropy.h"
#include "dtrain/engine/parallel/fused_block_ops.h"

namespace dtrain::engine {

AttentionImpl::AttentionImpl(int64_t d_model, int64_t h, double p, bool self)
    : heads(h), dropout(p), self_attention(self) {
  if (self) {
    qkv = register_module("qkv", Linear(d_model, 3 * d_model));
  } else {
    q = register_module("q", Linear(d_model, d_model));
    kv = register_module("kv", Linear(d_model, 2 * d_model));
  }
  out = register_module("out", Linear(d_model, d_model));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x_q, const at::Tensor& x_kv, bool causal) {
  const int64_t Tq = x_q.size(1), d = x_q.size(2), hd = d / heads;
  at::Tensor qh, kh, vh;
  // The batch dimension as -1, so a TorchScript trace (dtrain-export) accepts any batch size.
  auto split_heads = [&](const at::Tensor& t, int64_t T) {
    return t.view({-1, T, heads, hd}).transpose(1, 2);  // [B, h, T, hd]
  };
  if (self_attention) {
    auto parts = qkv->forward(x_q).chunk(3, -1);
    qh = split_heads(parts[0], Tq);
    kh = split_heads(parts[1], Tq);
    vh = split_heads(parts[2], Tq);
  } else {
    const int64_t Tk = x_kv.size(1);
    qh = split_heads(q->forward(x_q), Tq);
    auto parts = kv->forward(x_kv).chunk(2, -1);
    kh = split_heads(parts[0], Tk);
    vh = split_heads(parts[1], Tk);
  }
  at::Tensor a = at::scaled_dot_product_attention(qh, kh, vh, /*attn_mask=*/{},
                                                  is_training() ? dropout : 0.0, causal);
  return out->forward(a.transpose(1, 2).reshape({-1, Tq, d}));
}

FeedForwardImpl::FeedForwardImpl(int64_t d_model, int64_t ff, double p, bool in)
    : inplace(in) {
  fc1 = register_module("fc1", Linear(d_model, ff));
  fc2 = register_module("fc2", Linear(ff, d_model));
  drop = register_module("drop", torch::nn::Dropout(p));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) {
  at::Tensor h = fc1->forward(x);
  h = inplace ? h.relu_() : h.relu();  // safe: fc1's backward needs its input, not its output
  return fc2->forward(drop->forward(h));
}

namespace {
// A post-norm sublayer's norm(x + y): on CUDA the fused residual LayerNorm (fused_block_ops.h),
// its output in the sum's dtype (it is the residual stream, not only a Linear's input);
// elsewhere ATen's ops.
at::Tensor post_norm(torch::nn::LayerNorm& norm, const at::Tensor& x, const at::Tensor& y) {
  if (fused_block_kernels_serve(x)) {
    const at::ScalarType s = at::promote_types(x.scalar_type(), y.scalar_type());
    if (fused_add_layer_norm_available(x, y, norm->weight, norm->bias, s)) {
      return fused_add_layer_norm(x, y, norm->weight, norm->bias, norm->options.eps(), s).normed;
    }
  }
  return norm->forward(x + y);
}
}  // namespace

EncoderLayerImpl::EncoderLayerImpl(int64_t d, int64_t h, int64_t ff, double p, bool inplace) {
  self_attn = register_module("self_attn", Attention(d, h, p, true));
  ffn = register_module("ffn", FeedForward(d, ff, p, inplace));
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  drop1 = register_module("drop1", torch::nn::Dropout(p));
  drop2 = register_module("drop2", torch::nn::Dropout(p));
}

at::Tensor EncoderLayerImpl::forward(const at::Tensor& x) {
  at::Tensor h = post_norm(norm1, x, drop1->forward(self_attn->forward(x, x, false)));
  return post_norm(norm2, h, drop2->forward(ffn->forward(h)));
}

DecoderLayerImpl::DecoderLayerImpl(int64_t d, int64_t h, int64_t ff, double p, bool inplace) {
  self_attn = register_module("self_attn", Attention(d, h, p, true));
  cross_attn = register_module("cross_attn", Attention(d, h, p, false));
  ffn = register_module("ffn", FeedForward(d, ff, p, inplace));
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  norm3 = register_module("norm3", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  drop1 = register_module("drop1", torch::nn::Dropout(p));
  drop2 = register_module("drop2", torch::nn::Dropout(p));
  drop3 = register_module("drop3", torch::nn::Dropout(p));
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& memory) {
  at::Tensor h = post_norm(norm1, x, drop1->forward(self_attn->forward(x, x, true)));
  h = post_norm(norm2, h, drop2->forward(cross_attn->forward(h, memory, false)));
  return post_norm(norm3, h, drop3->forward(ffn->forward(h)));
}

Seq2SeqImpl::Seq2SeqImpl(const Seq2SeqOptions& o) : options(o) {
  src_embed = register_module("src_embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(o.vocab, o.d_model)
                                                                    .sparse(o.sparse_embedding)));
  tgt_embed = register_module("tgt_embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(o.vocab, o.d_model)
                                                                    .sparse(o.sparse_embedding)));
  encoder = register_module("encoder", torch::nn::ModuleList());
  decoder = register_module("decoder", torch::nn::ModuleList());
  for (int i = 0; i < o.layers; ++i) {
    encoder->push_back(EncoderLayer(o.d_model, o.heads, o.ff, o.dropout, o.inplace));
    decoder->push_back(DecoderLayer(o.d_model, o.heads, o.ff, o.dropout, o.inplace));
  }
  head = register_module("head", Linear(o.d_model, o.vocab));
  drop = register_module("drop", torch::nn::Dropout(o.dropout));
  at::Tensor pos = at::arange(o.max_len, at::kFloat).unsqueeze(1);
  at::Tensor div = at::exp(at::arange(0, o.d_model, 2, at::kFloat) * (-std::log(10000.0) / o.d_model));
  at::Tensor pe = at::zeros({o.max_len, o.d_model});
  pe.slice(1, 0, o.d_model, 2).copy_(at::sin(pos * div));
  pe.slice(1, 1, o.d_model, 2).copy_(at::cos(pos * div).narrow(1, 0, o.d_model / 2));
  positions = register_buffer("positions", pe);
}

at::Tensor Seq2SeqImpl::forward(const at::Tensor& src, const at::Tensor& tgt_in) {
  const double scale = std::sqrt(static_cast<double>(options.d_model));
  at::Tensor x = drop->forward(src_embed->forward(src) * scale + positions.narrow(0, 0, src.size(1)));
  const bool ckpt_on = options.checkpoint_activations && is_training();
  DTRAIN_CHECK(options.checkpoint_layers >= -1 && options.checkpoint_layers <= 2 * options.layers,
               "--checkpoint_blocks=", options.checkpoint_layers, " must be -1 (every layer) or at most the model's ",
               2 * options.layers, " layers (encoder and decoder)");
  int layer_index = 0;  // the encoder's layers first, then the decoder's
  auto ckpt = [&] { return ckpt_on && (options.checkpoint_layers < 0 || layer_index++ < options.checkpoint_layers); };
  for (auto& m : *encoder) {
    auto* layer = m->as<EncoderLayerImpl>();
    if (ckpt()) {
      x = checkpoint([layer](const at::Tensor& in) { return layer->forward(in); }, x,
                             layer->parameters());
    } else {
      x = layer->forward(x);
    }
  }
  at::Tensor memory = x;
  at::Tensor y = drop->forward(tgt_embed->forward(tgt_in) * scale + positions.narrow(0, 0, tgt_in.size(1)));
  for (auto& m : *decoder) {
    auto* layer = m->as<DecoderLayerImpl>();
    if (ckpt()) {
      y = checkpoint(
          [layer](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{layer->forward(in[0], in[1])}; },
          {y, memory}, layer->parameters())[0];
    } else {
      y = layer->forward(y, memory);
    }
  }
  return head->forward(y);
}

at::Tensor Seq2SeqImpl::loss(const at::Tensor& src, const at::Tensor& tgt_in, const at::Tensor& tgt_out) {
  at::Tensor logits = forward(src, tgt_in);
  // On CUDA dtrain's fused kernels (the same mean; the token ids are in [0, vocab)).
  at::Tensor flat = logits.reshape({-1, options.vocab});
  if (fused_cross_entropy_available(flat)) return fused_cross_entropy(flat, tgt_out.reshape({-1}));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, options.vocab}),
                                              tgt_out.reshape({-1}));
}

}  // namespace dtrain::engine
