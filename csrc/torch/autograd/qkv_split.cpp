// Autograd kernel of tempo::qkv_split: it saves nothing (the backward is a gather of the
// incoming gradients); a q, k or v that receives no gradient counts as zeros.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "tempo/ops/qkv_split.h"

namespace tempo {
namespace {

using autograd_impl::once_differentiable;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class QkvSplitFunction : public torch::autograd::Function<QkvSplitFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& z, const std::optional<at::Tensor>& bias,
                               int64_t heads) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [q, k, v] = qkv_split(z, bias, heads);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return {q, k, v};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::qkv_split", grads, [&]() -> variable_list {
      const at::Tensor& like = grads[0].defined() ? grads[0] : grads[1].defined() ? grads[1] : grads[2];
      auto g = [&](int i) { return grads[i].defined() ? grads[i] : at::zeros_like(like); };
      const bool has_bias = ctx->saved_data["has_bias"].toBool();
      auto [dz, db] = qkv_split_backward(g(0), g(1), g(2), has_bias);
      return {dz, has_bias ? db : at::Tensor(), at::Tensor()};
    });
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_split_autograd(const at::Tensor& z,
                                                                  const std::optional<at::Tensor>& bias,
                                                                  int64_t heads) {
  auto out = QkvSplitFunction::apply(z, bias, heads);
  return {out[0], out[1], out[2]};
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) { m.impl("qkv_split", tempo::qkv_split_autograd); }
