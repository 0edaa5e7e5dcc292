// Schemas and C++ API of tempo::layer_norm, tempo::rms_norm and
// tempo::bias_dropout_add_layer_norm. Their kernels: norm_kernels.cpp; the columns they keep:
// norm_kept_columns.cpp; the autograd kernels: ../autograd/norm.cpp; autocast: ../autocast.cpp.
#include "tempo/ops/norm.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  // kept_cols (norm_kept_columns(weight, bias)) may be passed in; when absent the autograd
  // kernel computes it. Under torch.compile pass it (tempo.layer_norm does): it has a
  // data-dependent size, which the compiled graph must see as the output of its own op.
  m.def(
      "layer_norm(Tensor x, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1e-05, "
      "Tensor? kept_cols=None) -> Tensor");
  // dtype: the data's (x's), when the parameters are float32 under bfloat16/float16 data.
  m.def(
      "layer_norm_forward(Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "Tensor? kept_cols=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_backward(Tensor grad, Tensor y, Tensor rstd, int[] normalized_shape, Tensor? weight, Tensor? bias, "
      "Tensor? kept_cols=None, Tensor? kept_xhat=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "rms_norm(Tensor x, int[] normalized_shape, Tensor? weight=None, float? eps=None, Tensor? kept_cols=None) "
      "-> Tensor");
  m.def(
      "rms_norm_forward(Tensor x, int[] normalized_shape, Tensor? weight, float? eps, Tensor? kept_cols=None) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "rms_norm_backward(Tensor grad, Tensor y, Tensor rstd, int[] normalized_shape, Tensor? weight, "
      "Tensor? kept_cols=None, Tensor? kept_xhat=None) -> (Tensor, Tensor)");
  m.def(
      "bias_dropout_add_layer_norm(Tensor x, Tensor? bias, Tensor residual, float p, Tensor? weight, Tensor? beta, "
      "float eps=1e-05, str mode='bits', Tensor? kept_cols=None) -> Tensor",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "bias_dropout_add_layer_norm_forward(Tensor x, Tensor? bias, Tensor residual, float p, Tensor? weight, "
      "Tensor? beta, float eps, str mode, Tensor? kept_cols=None) -> (Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "bias_dropout_add_layer_norm_backward(Tensor grad, Tensor y, Tensor rstd, Tensor keep, float p, str mode, "
      "Tensor? weight, Tensor? beta, bool has_bias, Tensor? kept_cols=None, Tensor? kept_xhat=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

namespace tempo {
using namespace torch_impl;

at::Tensor layer_norm(const at::Tensor& x, at::IntArrayRef shape, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, double eps) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                                        const std::optional<at::Tensor>&, double, const std::optional<at::Tensor>&)>(
      "tempo::layer_norm");
  return op.call(x, shape, weight, bias, eps, std::nullopt);
}

at::Tensor rms_norm(const at::Tensor& x, at::IntArrayRef shape, const std::optional<at::Tensor>& weight,
                    std::optional<double> eps) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                                        std::optional<double>, const std::optional<at::Tensor>&)>("tempo::rms_norm");
  return op.call(x, shape, weight, eps, std::nullopt);
}

at::Tensor bias_dropout_add_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                       const at::Tensor& residual, double p, const std::optional<at::Tensor>& weight,
                                       const std::optional<at::Tensor>& beta, double eps, c10::string_view mode,
                                       bool train) {
  check_probability(p, "tempo::bias_dropout_add_layer_norm", "p");
  static auto op =
      op_handle<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, double,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, c10::string_view,
                           const std::optional<at::Tensor>&)>("tempo::bias_dropout_add_layer_norm");
  return op.call(x, bias, residual, train ? p : 0.0, weight, beta, eps, mode, std::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(const at::Tensor& x, at::IntArrayRef shape,
                                                                  const std::optional<at::Tensor>& weight,
                                                                  const std::optional<at::Tensor>& bias, double eps,
                                                                  const std::optional<at::Tensor>& kept_cols) {
  static const auto& op = op_for<&layer_norm_forward>("tempo::layer_norm_forward");
  return op.call(x, shape, weight, bias, eps, kept_cols);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& grad, const at::Tensor& y,
                                                                   const at::Tensor& rstd, at::IntArrayRef shape,
                                                                   const std::optional<at::Tensor>& weight,
                                                                   const std::optional<at::Tensor>& bias,
                                                                   const std::optional<at::Tensor>& kept_cols,
                                                                   const std::optional<at::Tensor>& kept_xhat) {
  static const auto& op = op_for<&layer_norm_backward>("tempo::layer_norm_backward");
  return op.call(grad, y, rstd, shape, weight, bias, kept_cols, kept_xhat);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, at::IntArrayRef shape,
                                                                const std::optional<at::Tensor>& weight,
                                                                std::optional<double> eps,
                                                                const std::optional<at::Tensor>& kept_cols) {
  static const auto& op = op_for<&rms_norm_forward>("tempo::rms_norm_forward");
  return op.call(x, shape, weight, eps, kept_cols);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& y,
                                                     const at::Tensor& rstd, at::IntArrayRef shape,
                                                     const std::optional<at::Tensor>& weight,
                                                     const std::optional<at::Tensor>& kept_cols,
                                                     const std::optional<at::Tensor>& kept_xhat) {
  static const auto& op = op_for<&rms_norm_backward>("tempo::rms_norm_backward");
  return op.call(grad, y, rstd, shape, weight, kept_cols, kept_xhat);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& residual, double p,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& beta, double eps, c10::string_view mode,
    const std::optional<at::Tensor>& kept_cols) {
  static const auto& op = op_for<&bias_dropout_add_layer_norm_forward>("tempo::bias_dropout_add_layer_norm_forward");
  return op.call(x, bias, residual, p, weight, beta, eps, mode, kept_cols);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_backward(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd, const at::Tensor& keep, double p,
    c10::string_view mode, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& beta,
    bool has_bias, const std::optional<at::Tensor>& kept_cols, const std::optional<at::Tensor>& kept_xhat) {
  static const auto& op = op_for<&bias_dropout_add_layer_norm_backward>("tempo::bias_dropout_add_layer_norm_backward");
  return op.call(grad, y, rstd, keep, p, mode, weight, beta, has_bias, kept_cols, kept_xhat);
}

}  // namespace tempo
