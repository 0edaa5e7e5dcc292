#include "tempo/nn/attention.h"

#include <torch/nn/functional/linear.h>

#include <cmath>
#include <limits>
#include <utility>

#include "tempo/nn/checkpoint.h"
#include "tempo/nn/dropout.h"
#include "tempo/ops/attention.h"
#include "tempo/ops/fused_attention.h"
#include "tempo/ops/qkv_split.h"
#include "tempo/ops/rope.h"

namespace tempo::nn {

namespace {
const char* kOp = "tempo::nn::SelfAttention";

at::Tensor causal_keep(int64_t rows, int64_t cols, const at::TensorOptions& opts) {
  return at::ones({rows, cols}, opts.dtype(at::kBool)).tril();
}
}  // namespace

at::Tensor eager_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& mask, double dropout_p, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;
  const double ninf = -std::numeric_limits<double>::infinity();
  if (mask.has_value() && mask->defined())
    s = mask->scalar_type() == at::kBool ? s.masked_fill(mask->logical_not(), ninf) : s + *mask;
  if (causal) s = s.masked_fill(causal_keep(q.size(2), k.size(2), q.options()).logical_not(), ninf);
  at::Tensor p = at::softmax(s, -1);
  // A byte mask and the dropped probabilities, as nn.Dropout on CUDA keeps them (the mask
  // tempo::attention would draw from the same generator state).
  p = baseline_dropout(p, dropout_p);
  return at::matmul(p, v);
}

at::Tensor sdpa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double dropout_p, bool causal) {
  std::optional<at::Tensor> m;
  if (mask.has_value() && mask->defined()) m = mask->scalar_type() == at::kBool ? *mask : mask->to(q.scalar_type());
  if (causal && m.has_value()) {  // torch's sdpa takes either a mask or is_causal
    const at::Tensor keep = causal_keep(q.size(2), k.size(2), q.options());
    m = m->scalar_type() == at::kBool ? at::logical_and(*m, keep)
                                      : m->masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
    causal = false;
  }
  return at::scaled_dot_product_attention(q, k, v, m, dropout_p, causal);
}

std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t seq, int64_t head_dim, double theta,
                                                const at::TensorOptions& options) {
  TORCH_CHECK(head_dim % 2 == 0, kOp, ": rotary embedding needs an even head dim, got ", head_dim);
  at::NoGradGuard no_grad;
  const auto f = options.dtype(at::kFloat);
  const at::Tensor inv_freq = at::pow(theta, -at::arange(0, head_dim, 2, f) / static_cast<double>(head_dim));
  const at::Tensor freqs = at::outer(at::arange(seq, f), inv_freq);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(options.dtype()), emb.sin().to(options.dtype())};
}

SelfAttentionImpl::SelfAttentionImpl(SelfAttentionOptions options_) : options(std::move(options_)) {
  TORCH_CHECK(options.hidden() > 0 && options.heads() > 0, kOp, ": hidden and heads must be positive, got ",
              options.hidden(), " and ", options.heads());
  TORCH_CHECK(options.hidden() % options.heads() == 0, kOp, ": hidden (", options.hidden(),
              ") must be divisible by heads (", options.heads(), ")");
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() <= 1.0, kOp,
              ": dropout must be a probability in [0, 1], got ", options.dropout());
  const auto& b = options.backend();
  TORCH_CHECK(b == "tempo" || b == "sdpa" || b == "eager" || b == "fused" || b == "auto", kOp,
              ": backend must be 'tempo', 'sdpa', 'eager', 'fused' or 'auto', got '", b, "'");
  TORCH_CHECK(options.mode() == "bits" || options.mode() == "philox", kOp, ": mode must be 'bits' or 'philox', got '",
              options.mode(), "'");
  reset();
}

void SelfAttentionImpl::reset() {
  const int64_t h = options.hidden();
  qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(h, 3 * h).bias(options.bias())));
  out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(h, h).bias(options.bias())));
}

at::Tensor SelfAttentionImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& attention_mask,
                                      bool out_bias) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == options.hidden(), kOp, ": x must be [batch, seq, ", options.hidden(),
              "], got ", x.sizes());
  at::Tensor merged;
  if (options.recompute() && is_training() && at::GradMode::is_enabled()) {
    // Keep x only: the backward reruns the projection and the attention core (the same
    // dropout draws: checkpoint replays the generator) and backpropagates through them.
    std::vector<at::Tensor> in{x};
    if (attention_mask.has_value() && attention_mask->defined()) in.push_back(*attention_mask);
    merged = tempo::nn::checkpoint(
        [this](const std::vector<at::Tensor>& t) {
          return attend(t[0], t.size() > 1 ? std::optional<at::Tensor>(t[1]) : std::nullopt);
        },
        in);
  } else {
    merged = attend(x, attention_mask);
  }
  return out_bias ? out(merged) : at::linear(merged, out->weight);
}

at::Tensor SelfAttentionImpl::attend(const at::Tensor& x, const std::optional<at::Tensor>& attention_mask) {
  const int64_t B = x.size(0), S = x.size(1), A = options.heads(), d = options.hidden() / A;
  at::Tensor q, k, v;
  if (options.fused_qkv()) {
    const std::optional<at::Tensor> b = qkv->bias.defined() ? std::optional<at::Tensor>(qkv->bias) : std::nullopt;
    std::tie(q, k, v) = tempo::qkv_split(at::linear(x, qkv->weight), b, A);
  } else {
    // [B, S, 3, A, d] -> three [B, A, S, d] views of the one projection.
    const at::Tensor qkv_out = qkv(x).view({B, S, 3, A, d}).permute({2, 0, 3, 1, 4});
    q = qkv_out[0], k = qkv_out[1], v = qkv_out[2];
  }
  if (options.rotary()) {
    // The rotated q, k are new tensors (tempo::rope reads the projection's views in place); a
    // copy of v lets the projection's output go.
    const auto [cos, sin] = rotary_tables(S, d, options.rope_theta(), q.options());
    q = tempo::rope(q, cos, sin);
    k = tempo::rope(k, cos, sin);
    v = v.contiguous();
  }
  std::optional<at::Tensor> mask;
  if (attention_mask.has_value() && attention_mask->defined()) {
    const at::Tensor& m = *attention_mask;
    if (m.dim() == 2) {
      TORCH_CHECK(m.size(0) == B && m.size(1) == S, kOp, ": a 2-D attention_mask must be [batch, seq] = [", B, ", ", S,
                  "], got ", m.sizes());
      mask = (m != 0).view({B, 1, 1, S});
    } else {
      mask = m;
    }
  }
  const double p = is_training() ? options.dropout() : 0.0;
  std::string backend = options.backend();
  if (backend == "auto" || backend == "fused") {
    // sdpa when torch would run a fused kernel (no S^2 tensor kept), else tempo's.
    std::optional<at::Tensor> m = mask;
    if (m.has_value() && m->scalar_type() != at::kBool) m = m->to(q.scalar_type());
    const bool torch_fused = at::_fused_sdp_choice(q, k, v, m, p, options.causal()) != 0;
    backend = torch_fused ? "sdpa" : backend == "auto" ? "tempo" : "tempo-fused";
  }
  last_backend_ = backend;
  at::Tensor o;
  if (backend == "tempo")
    o = tempo::attention(q, k, v, mask, p, options.causal(), std::nullopt, options.mode());
  else if (backend == "tempo-fused")
    o = tempo::fused_attention(q, k, v, mask, p, options.causal());
  else if (backend == "sdpa")
    o = sdpa_attention(q, k, v, mask, p, options.causal());
  else
    o = eager_attention(q, k, v, mask, p, options.causal());
  return o.transpose(1, 2).reshape({B, S, options.hidden()});
}

void SelfAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "tempo::nn::SelfAttention(hidden=" << options.hidden() << ", heads=" << options.heads()
         << ", dropout=" << options.dropout() << ", causal=" << options.causal() << ", backend=" << options.backend()
         << ")";
}

}  // namespace tempo::nn
