#include "tempo/nn/norm.h"

#include <torch/nn/init.h>

#include "tempo/ops/norm.h"

namespace tempo::nn {

LayerNormImpl::LayerNormImpl(LayerNormOptions options_) : options(std::move(options_)) {
  TORCH_CHECK(!options.normalized_shape().empty(), "tempo::nn::LayerNorm: normalized_shape must not be empty");
  reset();
}
void LayerNormImpl::reset() {
  weight = bias = at::Tensor();
  if (options.elementwise_affine()) {
    weight = register_parameter("weight", torch::empty(options.normalized_shape()));
    if (options.bias()) bias = register_parameter("bias", torch::empty(options.normalized_shape()));
  }
  reset_parameters();
}
void LayerNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  if (weight.defined()) weight.fill_(1);
  if (bias.defined()) bias.zero_();
}
at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  return tempo::layer_norm(x, options.normalized_shape(),
                           weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt,
                           bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, options.eps());
}
void LayerNormImpl::pretty_print(std::ostream& stream) const {
  stream << "tempo::nn::LayerNorm(" << at::IntArrayRef(options.normalized_shape()) << ", eps=" << options.eps()
         << ", elementwise_affine=" << options.elementwise_affine() << ")";
}

RMSNormImpl::RMSNormImpl(RMSNormOptions options_) : options(std::move(options_)) {
  TORCH_CHECK(!options.normalized_shape().empty(), "tempo::nn::RMSNorm: normalized_shape must not be empty");
  reset();
}
void RMSNormImpl::reset() {
  weight = at::Tensor();
  if (options.elementwise_affine()) weight = register_parameter("weight", torch::empty(options.normalized_shape()));
  reset_parameters();
}
void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  if (weight.defined()) weight.fill_(1);
}
at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return tempo::rms_norm(x, options.normalized_shape(),
                         weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt, options.eps());
}
void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "tempo::nn::RMSNorm(" << at::IntArrayRef(options.normalized_shape()) << ")";
}

}  // namespace tempo::nn
