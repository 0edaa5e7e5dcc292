// Autograd kernels of tempo::layer_norm, tempo::rms_norm and
// tempo::bias_dropout_add_layer_norm: C++ autograd Functions at the Autograd key. Each saves
// y (the tensor the next layer keeps anyway), rstd (4 bytes per row), the parameters, the
// xhat of the few kept columns (norm_kept_columns: where recovery from y would lose
// precision; none in most models) and, for the fused op, the dropout bits or the 16-byte
// Philox state. Never x or h. Not twice differentiable: a second derivative raises.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "tempo/ops/norm.h"

namespace tempo {
namespace {

using autograd_impl::once_differentiable;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }
at::Tensor defined_or_empty(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }
// Absent gradients come from the ops as empty tensors: undefined for autograd.
at::Tensor grad_or_none(const at::Tensor& g, bool present) { return present ? g : at::Tensor(); }

// The kept columns: as passed in, else norm_kept_columns_for's (tempo/ops/norm.h: the one home
// of when a norm keeps columns).
std::optional<at::Tensor> kept_columns(const std::optional<at::Tensor>& given, const at::Tensor& x,
                                       const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& beta,
                                       std::initializer_list<const at::Tensor*> inputs) {
  if (given.has_value() && given->defined()) return given;
  bool backward = false;
  for (const at::Tensor* t : inputs) backward = backward || (t && t->defined() && t->requires_grad());
  return norm_kept_columns_for(x, weight, beta, backward && at::GradMode::is_enabled());
}

const at::Tensor* ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef shape,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
                            const std::optional<at::Tensor>& kept_cols) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd, kept_xhat] = layer_norm_forward(x, shape, weight, bias, eps, kept_cols);
    ctx->save_for_backward({autograd_impl::saved_output(y), rstd, defined_or_empty(weight), defined_or_empty(bias),
                            defined_or_empty(kept_cols), kept_xhat});
    ctx->saved_data["shape"] = shape.vec();
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::layer_norm", grads, [&]() -> variable_list {
      const auto s = ctx->get_saved_variables();
      const auto shape = ctx->saved_data["shape"].toIntVector();
      auto [gx, gw, gb] = layer_norm_backward(grads[0], s[0], s[1], shape, opt(s[2]), opt(s[3]), opt(s[4]), opt(s[5]));
      return {gx,           at::Tensor(), grad_or_none(gw, s[2].defined()), grad_or_none(gb, s[3].defined()),
              at::Tensor(), at::Tensor()};
    });
  }
};

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef shape,
                            const std::optional<at::Tensor>& weight, std::optional<double> eps,
                            const std::optional<at::Tensor>& kept_cols) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd, kept_xhat] = rms_norm_forward(x, shape, weight, eps, kept_cols);
    ctx->save_for_backward(
        {autograd_impl::saved_output(y), rstd, defined_or_empty(weight), defined_or_empty(kept_cols), kept_xhat});
    ctx->saved_data["shape"] = shape.vec();
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::rms_norm", grads, [&]() -> variable_list {
      const auto s = ctx->get_saved_variables();
      const auto shape = ctx->saved_data["shape"].toIntVector();
      auto [gx, gw] = rms_norm_backward(grads[0], s[0], s[1], shape, opt(s[2]), opt(s[3]), opt(s[4]));
      return {gx, at::Tensor(), grad_or_none(gw, s[2].defined()), at::Tensor(), at::Tensor()};
    });
  }
};

class BiasDropoutAddLayerNormFunction : public torch::autograd::Function<BiasDropoutAddLayerNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                            const at::Tensor& residual, double p, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& beta, double eps, c10::string_view mode,
                            const std::optional<at::Tensor>& kept_cols) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd, keep, kept_xhat] =
        bias_dropout_add_layer_norm_forward(x, bias, residual, p, weight, beta, eps, mode, kept_cols);
    ctx->save_for_backward({autograd_impl::saved_output(y), rstd, keep, defined_or_empty(weight),
                            defined_or_empty(beta), defined_or_empty(kept_cols), kept_xhat});
    ctx->saved_data["p"] = p;
    ctx->saved_data["mode"] = std::string(mode);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::bias_dropout_add_layer_norm", grads, [&]() -> variable_list {
      const auto s = ctx->get_saved_variables();
      const bool has_bias = ctx->saved_data["has_bias"].toBool();
      auto [gx, gbias, gres, gw, gbeta] = bias_dropout_add_layer_norm_backward(
          grads[0], s[0], s[1], s[2], ctx->saved_data["p"].toDouble(), ctx->saved_data["mode"].toStringRef(), opt(s[3]),
          opt(s[4]), has_bias, opt(s[5]), opt(s[6]));
      return {gx,
              grad_or_none(gbias, has_bias),
              gres,
              at::Tensor(),
              grad_or_none(gw, s[3].defined()),
              grad_or_none(gbeta, s[4].defined()),
              at::Tensor(),
              at::Tensor(),
              at::Tensor()};
    });
  }
};

at::Tensor layer_norm_autograd(const at::Tensor& x, at::IntArrayRef shape, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps,
                               const std::optional<at::Tensor>& kept_cols) {
  return LayerNormFunction::apply(x, shape, weight, bias, eps,
                                  kept_columns(kept_cols, x, weight, bias, {&x, ptr(weight), ptr(bias)}));
}
at::Tensor rms_norm_autograd(const at::Tensor& x, at::IntArrayRef shape, const std::optional<at::Tensor>& weight,
                             std::optional<double> eps, const std::optional<at::Tensor>& kept_cols) {
  return RmsNormFunction::apply(x, shape, weight, eps,
                                kept_columns(kept_cols, x, weight, std::nullopt, {&x, ptr(weight)}));
}
at::Tensor bias_dropout_add_layer_norm_autograd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                                const at::Tensor& residual, double p,
                                                const std::optional<at::Tensor>& weight,
                                                const std::optional<at::Tensor>& beta, double eps,
                                                c10::string_view mode, const std::optional<at::Tensor>& kept_cols) {
  return BiasDropoutAddLayerNormFunction::apply(
      x, bias, residual, p, weight, beta, eps, mode,
      kept_columns(kept_cols, x, weight, beta, {&x, ptr(bias), &residual, ptr(weight), ptr(beta)}));
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) {
  m.impl("layer_norm", tempo::layer_norm_autograd);
  m.impl("rms_norm", tempo::rms_norm_autograd);
  m.impl("bias_dropout_add_layer_norm", tempo::bias_dropout_add_layer_norm_autograd);
}
