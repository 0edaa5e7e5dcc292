// Autograd kernels of tempo::gelu and tempo::silu: a C++ autograd Function below the
// Autograd dispatch key (not twice differentiable: a second derivative raises), so the same backward serves LibTorch
// C++ and Python. It saves the output y (the tensor the next layer keeps anyway) and the 1-bit mask, nothing else.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "tempo/ops/activation.h"

namespace tempo {
namespace {

using autograd_impl::once_differentiable;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// With a bias, its gradient (grad_x summed over all but the last dim) comes from the backward
// kernel's same pass.
at::Tensor bias_grad(const at::Tensor& gb, bool has_bias) { return has_bias ? gb : at::Tensor(); }

class GeluFunction : public torch::autograd::Function<GeluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::string_view approximate,
                            const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mask] = gelu_forward(x, approximate, bias);
    ctx->save_for_backward({autograd_impl::saved_output(y), mask});
    ctx->saved_data["approximate"] = std::string(approximate);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::gelu", grads, [&]() -> variable_list {
      const auto saved = ctx->get_saved_variables();
      const std::string approximate = ctx->saved_data["approximate"].toStringRef();
      const bool has_bias = ctx->saved_data["has_bias"].toBool();
      auto [gx, gb] = gelu_backward(grads[0], saved[0], saved[1], approximate, has_bias);
      return {gx, at::Tensor(), bias_grad(gb, has_bias)};
    });
  }
};

class SiluFunction : public torch::autograd::Function<SiluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, mask] = silu_forward(x, bias);
    ctx->save_for_backward({autograd_impl::saved_output(y), mask});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::silu", grads, [&]() -> variable_list {
      const auto saved = ctx->get_saved_variables();
      const bool has_bias = ctx->saved_data["has_bias"].toBool();
      auto [gx, gb] = silu_backward(grads[0], saved[0], saved[1], has_bias);
      return {gx, bias_grad(gb, has_bias)};
    });
  }
};

at::Tensor gelu_autograd(const at::Tensor& x, c10::string_view approximate, const std::optional<at::Tensor>& bias) {
  return GeluFunction::apply(x, approximate, bias);
}
at::Tensor silu_autograd(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  return SiluFunction::apply(x, bias);
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) {
  m.impl("gelu", tempo::gelu_autograd);
  m.impl("silu", tempo::silu_autograd);
}
