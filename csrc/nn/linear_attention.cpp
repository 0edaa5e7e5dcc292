#include "tempo/nn/linear_attention.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include "tempo/ops/linear_attention.h"

namespace tempo::nn {

namespace {
const char* kFeatures = "tempo::nn::FeatureMap";
const char* kAttention = "tempo::nn::CausalLinearAttention";

bool known_feature_map(const std::string& k) { return k == "relu" || k == "elu" || k == "sqr" || k == "favor"; }
}  // namespace

// ---- feature maps ---------------------------------------------------------------------------

FeatureMapImpl::FeatureMapImpl(std::string kind_, int64_t head_dim_, int64_t features_)
    : kind(std::move(kind_)), head_dim(head_dim_), features(kind == "favor" && features_ > 0 ? features_ : head_dim_) {
  TORCH_CHECK(known_feature_map(kind), kFeatures, ": unknown feature map '", kind, "'; known: relu, elu, sqr, favor");
  TORCH_CHECK(head_dim > 0, kFeatures, ": head_dim must be positive, got ", head_dim);
  reset();
}

void FeatureMapImpl::reset() {
  if (kind != "favor") return;
  projection = register_buffer("projection", at::empty({features, head_dim}));
  redraw();
}

void FeatureMapImpl::redraw(std::optional<at::Generator> generator) {
  if (kind != "favor") return;
  // Blocks of d orthogonal rows (Haar-distributed: QR's Q with the signs of R's diagonal),
  // each row rescaled to a chi(d)-distributed length, as a Gaussian row would have.
  const int64_t d = head_dim, m = features;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  std::vector<at::Tensor> blocks;
  for (int64_t i = 0; i < (m + d - 1) / d; ++i) {
    const at::Tensor g = at::normal(0.0, 1.0, {d, d}, generator, f64);
    auto [q, r] = at::linalg_qr(g);
    blocks.push_back((q * at::sign(at::diagonal(r)).unsqueeze(0)).t());
  }
  const at::Tensor w = at::cat(blocks).narrow(0, 0, m);
  const at::Tensor norms = at::normal(0.0, 1.0, {m, d}, generator, f64).norm(2, {1}, true);
  c10::NoGradGuard no_grad;
  projection.copy_(w * norms);
}

at::Tensor FeatureMapImpl::forward(const at::Tensor& x, bool is_query) {
  if (kind == "relu") return at::relu(x);
  if (kind == "elu") return at::elu(x) + 1;
  if (kind == "sqr") return x * x;
  const at::Tensor xs = x * std::pow(static_cast<double>(head_dim), -0.25);
  at::Tensor logits = at::matmul(xs, projection.to(x.scalar_type()).t()) - (xs * xs).sum(-1, true) / 2;
  if (is_query) logits = logits - std::get<0>(logits.max(-1, true)).detach();
  return at::exp(logits) / std::sqrt(static_cast<double>(features));
}

void FeatureMapImpl::pretty_print(std::ostream& s) const {
  s << "tempo::nn::FeatureMap(" << kind << ", head_dim=" << head_dim << ", features=" << features << ")";
}

// ---- attention ------------------------------------------------------------------------------

CausalLinearAttentionImpl::CausalLinearAttentionImpl(CausalLinearAttentionOptions options_)
    : options(std::move(options_)) {
  reset();
}

void CausalLinearAttentionImpl::reset() {
  const auto& o = options;
  TORCH_CHECK(o.d_model() > 0 && o.heads() > 0 && o.d_model() % o.heads() == 0, kAttention, ": d_model ", o.d_model(),
              " must be a positive multiple of heads ", o.heads());
  TORCH_CHECK(o.mode() == "iterative" || o.mode() == "prefix", kAttention, ": mode must be iterative or prefix, got '",
              o.mode(), "'");
  qkv = register_module("qkv", torch::nn::Linear(o.d_model(), 3 * o.d_model()));
  out = register_module("out", torch::nn::Linear(o.d_model(), o.d_model()));
  feature_map = register_module("feature_map", FeatureMap(o.feature_map(), o.d_model() / o.heads(), o.features()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> CausalLinearAttentionImpl::features(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == options.d_model(), kAttention, ": x must be [batch, length, ",
              options.d_model(), "], got ", x.sizes());
  const int64_t B = x.size(0), L = x.size(1), A = options.heads(), d = options.d_model() / A;
  const at::Tensor qkv_ = qkv->forward(x).view({B, L, 3, A, d}).permute({2, 0, 3, 1, 4});
  return {feature_map->forward(qkv_[0], true), feature_map->forward(qkv_[1], false), qkv_[2]};
}

at::Tensor CausalLinearAttentionImpl::merge(const at::Tensor& y) {
  const int64_t B = y.size(0), L = y.size(2);
  return out->forward(y.transpose(1, 2).reshape({B, L, -1}));
}

std::tuple<at::Tensor, LinearAttentionState> CausalLinearAttentionImpl::forward(const at::Tensor& x,
                                                                                const LinearAttentionState& state) {
  auto [qf, kf, v] = features(x);
  std::optional<at::Tensor> num, den;
  if (state.defined()) num = state.num, den = state.den;
  auto [y, n, z] = tempo::causal_linear_attention(qf, kf, v, num, den, options.eps(), options.mode());
  return {merge(y), LinearAttentionState{n, z}};
}

std::tuple<at::Tensor, LinearAttentionState, LinearAttentionState> CausalLinearAttentionImpl::forward_rebuilding(
    const at::Tensor& x, const LinearAttentionState& after) {
  TORCH_CHECK(after.defined(), kAttention, ": forward_rebuilding needs the state after x");
  auto [qf, kf, v] = features(x);
  LinearAttentionState before;
  {
    c10::NoGradGuard no_grad;
    const auto st = after.num.scalar_type();
    const at::Tensor k = kf.to(st);
    before.num = (after.num - at::matmul(k.transpose(-1, -2), v.to(st))).requires_grad_();
    before.den = (after.den - k.sum(-2)).requires_grad_();
  }
  auto [y, n, z] = tempo::causal_linear_attention(qf, kf, v, before.num, before.den, options.eps(), options.mode());
  return {merge(y), LinearAttentionState{n, z}, before};
}

void CausalLinearAttentionImpl::pretty_print(std::ostream& s) const {
  s << "tempo::nn::CausalLinearAttention(d_model=" << options.d_model() << ", heads=" << options.heads()
    << ", feature_map=" << options.feature_map() << ", mode=" << options.mode() << ")";
}

}  // namespace tempo::nn
