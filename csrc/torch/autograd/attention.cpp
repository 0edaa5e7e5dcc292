// Autograd kernel of tempo::attention, which saves q, k, v (the projections keep them
// anyway), P and the dropout bits or Philox state (not the logits, not the dropped
// probabilities).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "tempo/ops/attention.h"

namespace tempo {
namespace {

using autograd_impl::once_differentiable;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                            std::optional<double> scale, c10::string_view mode) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, probs, keep] = attention_forward(q, k, v, attn_mask, dropout_p, causal, scale, mode);
    ctx->save_for_backward({q, k, v, probs, keep});
    ctx->saved_data["p"] = dropout_p;
    ctx->saved_data["mode"] = std::string(mode);
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::attention", grads, [&]() -> variable_list {
      const auto s = ctx->get_saved_variables();
      const c10::IValue& sc = ctx->saved_data["scale"];
      auto [dq, dk, dv] = attention_backward(grads[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["p"].toDouble(),
                                             sc.isNone() ? std::nullopt : std::optional<double>(sc.toDouble()),
                                             ctx->saved_data["mode"].toStringRef());
      return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                              std::optional<double> scale, c10::string_view mode) {
  return AttentionFunction::apply(q, k, v, attn_mask, dropout_p, causal, scale, mode);
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) { m.impl("attention", tempo::attention_autograd); }
