// Autograd kernel of tempo::dropout: saves the packed keep bits ("bits") or only the
// 16-byte Philox state ("philox"), never x or a byte mask. Dropout is linear, so its backward
// (the same masked scaling of the gradient) is itself differentiable, to any order.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "tempo/ops/dropout.h"

namespace tempo {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// g -> mask * g / (1 - p) with the forward's mask; its own backward is the same map.
class DropoutBackwardFunction : public torch::autograd::Function<DropoutBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& keep, double p,
                            const std::string& mode) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({keep});
    ctx->saved_data["p"] = p;
    ctx->saved_data["mode"] = mode;
    return dropout_backward(g, keep, p, mode);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    return {apply(grads[0], s[0], ctx->saved_data["p"].toDouble(), ctx->saved_data["mode"].toStringRef()), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

class DropoutFunction : public torch::autograd::Function<DropoutFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double p, c10::string_view mode) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, keep] = dropout_forward(x, p, mode);
    ctx->save_for_backward({keep});
    ctx->saved_data["p"] = p;
    ctx->saved_data["mode"] = std::string(mode);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    at::Tensor gx = DropoutBackwardFunction::apply(grads[0], s[0], ctx->saved_data["p"].toDouble(),
                                                   ctx->saved_data["mode"].toStringRef());
    return {gx, at::Tensor(), at::Tensor()};
  }
};

at::Tensor dropout_autograd(const at::Tensor& x, double p, c10::string_view mode) {
  return DropoutFunction::apply(x, p, mode);
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) { m.impl("dropout", tempo::dropout_autograd); }
