// Autograd kernel of tempo::causal_linear_attention (iterative mode): saves the inputs and the
// state in, nothing of size C x M x D; the backward op rebuilds the running sums.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "tempo/ops/linear_attention.h"

namespace tempo {
namespace {

using autograd_impl::once_differentiable;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class CausalLinearAttentionFunction : public torch::autograd::Function<CausalLinearAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& num, const std::optional<at::Tensor>& den, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, num_out, den_out] = causal_linear_attention_forward(q, k, v, num, den, eps);
    const bool has_state = num.has_value() && num->defined();
    ctx->save_for_backward({q, k, v, has_state ? *num : at::Tensor(), has_state ? *den : at::Tensor()});
    ctx->saved_data["eps"] = eps;
    return {y, num_out, den_out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::causal_linear_attention", grads, [&]() -> variable_list {
      const auto s = ctx->get_saved_variables();
      const double eps = ctx->saved_data["eps"].toDouble();
      const at::Tensor gy = grads[0].defined() ? grads[0] : at::zeros_like(s[2]);
      auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
      auto [gq, gk, gv, gnum, gden] = causal_linear_attention_backward(gy, opt(grads[1]), opt(grads[2]), s[0], s[1],
                                                                       s[2], opt(s[3]), opt(s[4]), eps);
      return {gq, gk, gv, gnum, gden, at::Tensor()};
    });
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> autograd_kernel(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v,
                                                               const std::optional<at::Tensor>& num,
                                                               const std::optional<at::Tensor>& den, double eps) {
  auto out = CausalLinearAttentionFunction::apply(q, k, v, num, den, eps);
  return {out[0], out[1], out[2]};
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) { m.impl("causal_linear_attention", tempo::autograd_kernel); }
