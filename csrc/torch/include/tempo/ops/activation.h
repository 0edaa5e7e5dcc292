// C++ API of the in-place activations. Autograd works through these exactly as through
// at::gelu / at::silu; the backward keeps only the output and a 1-bit mask.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace tempo {

// f(x + bias) with f = GELU (approximate = "none" | "tanh"); bias (optional) has
// x.size(-1) elements. Same values and gradients as torch::nn::functional::gelu.
at::Tensor gelu(const at::Tensor& x, c10::string_view approximate = "none",
                const std::optional<at::Tensor>& bias = std::nullopt);
// f(x + bias) with f = SiLU, as torch::nn::functional::silu.
at::Tensor silu(const at::Tensor& x, const std::optional<at::Tensor>& bias = std::nullopt);

// The forward and backward ops behind them: (y, packed mask), and (the input gradient, the
// bias gradient summed in the same pass when bias_grad, else an empty tensor).
std::tuple<at::Tensor, at::Tensor> gelu_forward(const at::Tensor& x, c10::string_view approximate,
                                                const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> gelu_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                                                 c10::string_view approximate, bool bias_grad = false);
std::tuple<at::Tensor, at::Tensor> silu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> silu_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                                                 bool bias_grad = false);

}  // namespace tempo
