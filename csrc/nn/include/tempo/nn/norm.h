// Drop-in modules for torch::nn::LayerNorm and torch::nn::RMSNorm whose backward keeps only
// the output and one rstd per row (see tempo/ops/norm.h). Parameters are named "weight"
// and "bias" with torch's shapes, so state dicts load unchanged in either direction.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <vector>

namespace tempo::nn {

struct LayerNormOptions {
  /* implicit */ LayerNormOptions(std::vector<int64_t> normalized_shape)
      : normalized_shape_(std::move(normalized_shape)) {}
  TORCH_ARG(std::vector<int64_t>, normalized_shape);
  TORCH_ARG(double, eps) = 1e-5;
  TORCH_ARG(bool, elementwise_affine) = true;
  TORCH_ARG(bool, bias) = true;  // with elementwise_affine: learn beta too
};

class LayerNormImpl : public torch::nn::Cloneable<LayerNormImpl> {
 public:
  explicit LayerNormImpl(LayerNormOptions options);
  at::Tensor forward(const at::Tensor& x);
  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  LayerNormOptions options;
  at::Tensor weight, bias;  // undefined when not learned
};
TORCH_MODULE(LayerNorm);

struct RMSNormOptions {
  /* implicit */ RMSNormOptions(std::vector<int64_t> normalized_shape)
      : normalized_shape_(std::move(normalized_shape)) {}
  TORCH_ARG(std::vector<int64_t>, normalized_shape);
  TORCH_ARG(std::optional<double>, eps) = std::nullopt;  // nullopt: machine epsilon of the input dtype
  TORCH_ARG(bool, elementwise_affine) = true;
};

class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  explicit RMSNormImpl(RMSNormOptions options);
  at::Tensor forward(const at::Tensor& x);
  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  RMSNormOptions options;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

}  // namespace tempo::nn
