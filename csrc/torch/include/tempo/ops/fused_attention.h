// C++ API of tempo's fused attention (see tempo/ops/attention.h for the arguments).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace tempo {

// Memory-efficient attention: the same result as attention() (dropout draws the same mask
// from the same generator state), computed over blocks of `block_rows` query rows (0: rows
// chosen so a block's scores take about 8 MiB), keeping for backward only q, k, v, the mask
// and the 16-byte Philox state, no S^2 tensor. The backward recomputes each block's P.
at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& attn_mask = std::nullopt, double dropout_p = 0.0,
                           bool causal = false, std::optional<double> scale = std::nullopt, int64_t block_rows = 0);
// Whether fused_attention runs torch's scaled_dot_product_attention instead (its flash or
// memory-efficient CUDA kernels, also keeping no S^2 tensor): on CUDA, without a mask or
// dropout (where the semantics are the same: no fully masked rows, no mask to draw), with the
// default block_rows, for 16/32-bit data, causal only for square scores. The environment
// variable TEMPO_FUSED_ATTENTION=tempo keeps tempo's own kernel everywhere. The op
// tempo::fused_attention_backend names the choice ("torch-sdpa" or "tempo").
bool fused_attention_uses_sdpa(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& attn_mask,
                               double dropout_p, bool causal, int64_t block_rows);
// (out, state)
std::tuple<at::Tensor, at::Tensor> fused_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v,
                                                           const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                           bool causal, std::optional<double> scale,
                                                           int64_t block_rows);
// (dq, dk, dv)
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal, std::optional<double> scale,
    int64_t block_rows);

}  // namespace tempo
