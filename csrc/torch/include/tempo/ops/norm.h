// C++ API of tempo's in-place norms. Values and gradients as torch's layer_norm / rms_norm;
// the backward keeps only the output y (shared with the next layer), one rstd per row and
// the parameters, and recovers xhat from y, keeping xhat only for the few columns where
// that would lose precision (see tempo/norm.h for the column rule).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace tempo {

at::Tensor layer_norm(const at::Tensor& x, at::IntArrayRef normalized_shape,
                      const std::optional<at::Tensor>& weight = std::nullopt,
                      const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5);
// eps = nullopt: the machine epsilon of the math type (fp32 for 16-bit x), as torch's rms_norm.
at::Tensor rms_norm(const at::Tensor& x, at::IntArrayRef normalized_shape,
                    const std::optional<at::Tensor>& weight = std::nullopt, std::optional<double> eps = std::nullopt);
// LayerNorm(residual + dropout(x + bias)) over the last dimension, in one pass; keeps y,
// rstd and the dropout bits ("bits") or the Philox state ("philox"). !train or p = 0: no dropout.
at::Tensor bias_dropout_add_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                       const at::Tensor& residual, double p, const std::optional<at::Tensor>& weight,
                                       const std::optional<at::Tensor>& beta, double eps = 1e-5,
                                       c10::string_view mode = "bits", bool train = true);

// The forward/backward ops. Absent gradients come back as empty (numel 0) tensors.
//
// Exactness for every gamma and beta: norm_kept_columns(weight, bias) lists (int64, ascending)
// the columns whose xhat cannot be recovered from y within the stated bound (tempo/norm.h:
// norm_column_recoverable); a forward given them also returns their xhat (kept_xhat: rows x
// kept, fp32, fp64 for fp64 data), and the backward given both is exact in those columns.
// Without kept_cols every column is recovered from y. On CUDA norm_kept_columns reads the
// parameters on the host (a sync). dtype: the data's, when it is not the parameters' (float32
// parameters under bfloat16/float16 data); the rule is the data's.
//
// Parameters (weight and bias/beta) are of x's dtype, or float32 for a bfloat16/float16 x, as
// torch's CPU layer_norm takes them (and autocast on CPU leaves them): gamma and beta then
// enter unrounded, and their gradients come back in float32.
at::Tensor norm_kept_columns(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             std::optional<at::ScalarType> dtype = std::nullopt);
// The same in a fixed number of slots for the width, padded with -1 (what CUDA computes, on
// every device): a size that does not depend on the values.
at::Tensor norm_kept_slots(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           std::optional<at::ScalarType> dtype = std::nullopt);
// The one home of when a norm keeps columns (the autograd kernels call it for a forward given
// no kept_cols; Python passes none): nothing without parameters, for parameters the op rejects
// (unlike x in device, or of a dtype other than x's or float32 under a 16-bit x: the op then
// names them), or when no backward will run (`backward`: grad mode on and an input requiring
// it); norm_kept_slots for a traced x (meta, fake or functional tensors: torch.compile, make_fx),
// so the graph holds no data-dependent size; else norm_kept_columns.
std::optional<at::Tensor> norm_kept_columns_for(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                const std::optional<at::Tensor>& beta, bool backward);
// (y, rstd, kept_xhat)
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, const std::optional<at::Tensor>& kept_cols = std::nullopt);
// (grad_x, grad_weight, grad_bias)
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& kept_cols = std::nullopt,
    const std::optional<at::Tensor>& kept_xhat = std::nullopt);
// (y, rstd, kept_xhat)
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_forward(
    const at::Tensor& x, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    std::optional<double> eps, const std::optional<at::Tensor>& kept_cols = std::nullopt);
// (grad_x, grad_weight)
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& y,
                                                     const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                                     const std::optional<at::Tensor>& weight,
                                                     const std::optional<at::Tensor>& kept_cols = std::nullopt,
                                                     const std::optional<at::Tensor>& kept_xhat = std::nullopt);
// (y, rstd, keep, kept_xhat): keep as for dropout_forward (empty for p = 0)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& residual, double p,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& beta, double eps, c10::string_view mode,
    const std::optional<at::Tensor>& kept_cols = std::nullopt);
// (grad_x, grad_bias, grad_residual, grad_weight, grad_beta)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_backward(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd, const at::Tensor& keep, double p,
    c10::string_view mode, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& beta,
    bool has_bias, const std::optional<at::Tensor>& kept_cols = std::nullopt,
    const std::optional<at::Tensor>& kept_xhat = std::nullopt);

}  // namespace tempo
