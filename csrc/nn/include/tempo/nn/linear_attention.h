// Multi-head causal linear attention (Performer-style) over chunks with a carried state, on
// tempo::causal_linear_attention, and its feature maps. The same modules as Python's
// tempo.nn.FeatureMap and tempo.nn.CausalLinearAttention (same parameter names).
#pragma once

#include <ATen/core/Generator.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <tuple>

namespace tempo::nn {

// A layer's prefix-sum state: numerator sum [B, A, M, d] and denominator sum [B, A, M].
struct LinearAttentionState {
  at::Tensor num, den;
  bool defined() const { return num.defined(); }
};

// x [..., d] -> non-negative features [..., M]: relu (M = d), elu + 1 (M = d), sqr (x^2, M = d)
// or FAVOR+ (positive orthogonal random features, M = `features`, default d):
// exp(w_i . x' - |x'|^2 / 2) / sqrt(M) with x' = x / d^(1/4). Queries subtract their row's
// largest exponent (it cancels in the attention's ratio); keys may not (it would tie a key to
// its chunk). redraw() draws new orthogonal features (buffer "projection").
class FeatureMapImpl : public torch::nn::Cloneable<FeatureMapImpl> {
 public:
  FeatureMapImpl(std::string kind, int64_t head_dim, int64_t features = 0);
  at::Tensor forward(const at::Tensor& x, bool is_query);
  void redraw(std::optional<at::Generator> generator = std::nullopt);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  std::string kind;
  int64_t head_dim, features;
  at::Tensor projection;  // FAVOR+ only: [features, head_dim]
};
TORCH_MODULE(FeatureMap);

struct CausalLinearAttentionOptions {
  CausalLinearAttentionOptions(int64_t d_model, int64_t heads) : d_model_(d_model), heads_(heads) {}
  TORCH_ARG(int64_t, d_model);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(std::string, feature_map) = "sqr";  // relu | elu | sqr | favor
  TORCH_ARG(int64_t, features) = 0;             // FAVOR+'s M (0: the head dim)
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(std::string, mode) = "iterative";  // iterative | prefix (see tempo/ops/linear_attention.h)
};

// x [B, L, d_model] and the state before x (undefined: zeros) -> (y [B, L, d_model], the state
// after x). Calls over consecutive chunks with the state carried give one call's output over
// the whole sequence. Submodules "qkv" (one GEMM for q, k, v), "out", "feature_map".
class CausalLinearAttentionImpl : public torch::nn::Cloneable<CausalLinearAttentionImpl> {
 public:
  explicit CausalLinearAttentionImpl(CausalLinearAttentionOptions options);
  std::tuple<at::Tensor, LinearAttentionState> forward(const at::Tensor& x, const LinearAttentionState& state = {});
  // SLiM's backward step: the state before x rebuilt from the state after it minus x's own
  // sums (from the same features the attention uses), as leaves that require grad. Returns
  // (y, state after x, that rebuilt state before x).
  std::tuple<at::Tensor, LinearAttentionState, LinearAttentionState> forward_rebuilding(
      const at::Tensor& x, const LinearAttentionState& state_after);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  CausalLinearAttentionOptions options;
  torch::nn::Linear qkv{nullptr}, out{nullptr};
  FeatureMap feature_map{nullptr};

 private:
  std::tuple<at::Tensor, at::Tensor, at::Tensor> features(const at::Tensor& x);
  at::Tensor merge(const at::Tensor& y);
};
TORCH_MODULE(CausalLinearAttention);

}  // namespace tempo::nn
