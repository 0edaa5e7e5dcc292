// Autograd kernel of tempo::fused_attention, which saves q, k, v (the projections keep them
// anyway), the mask and the 16-byte Philox state: no S^2 tensor. On CUDA, where the
// semantics match (fused_attention_uses_sdpa), it is torch's scaled_dot_product_attention
// (flash or memory-efficient kernels, which keep q, k, v, the output and a log-sum-exp
// per row): our own CUDA kernel is a correct reference, not a fast one.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "tempo/ops/fused_attention.h"

namespace tempo {
namespace {

using autograd_impl::once_differentiable;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                            std::optional<double> scale, int64_t block_rows) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, state] = fused_attention_forward(q, k, v, attn_mask, dropout_p, causal, scale, block_rows);
    const at::Tensor mask = attn_mask.has_value() ? *attn_mask : at::Tensor();
    ctx->save_for_backward({q, k, v, state, mask});
    ctx->saved_data["p"] = dropout_p;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    ctx->saved_data["block_rows"] = block_rows;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::fused_attention", grads, [&]() -> variable_list {
      const auto s = ctx->get_saved_variables();
      const c10::IValue& sc = ctx->saved_data["scale"];
      auto [dq, dk, dv] = fused_attention_backward(
          grads[0], s[0], s[1], s[2], s[3], s[4].defined() ? std::optional<at::Tensor>(s[4]) : std::nullopt,
          ctx->saved_data["p"].toDouble(), ctx->saved_data["causal"].toBool(),
          sc.isNone() ? std::nullopt : std::optional<double>(sc.toDouble()), ctx->saved_data["block_rows"].toInt());
      return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

at::Tensor fused_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                                    std::optional<double> scale, int64_t block_rows) {
  if (fused_attention_uses_sdpa(q, k, attn_mask, dropout_p, causal, block_rows))
    return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal, scale);
  return FusedAttentionFunction::apply(q, k, v, attn_mask, dropout_p, causal, scale, block_rows);
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) { m.impl("fused_attention", tempo::fused_attention_autograd); }
