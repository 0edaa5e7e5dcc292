// C++ API of tempo::qkv_split, the attention input bias (Ivanov et al.'s "aib"): z, the one
// q/k/v projection x W^T without its bias ([batch, seq, 3 hidden], hidden = heads head_dim,
// q's columns first), plus the bias ([3 hidden], optional), written once as q, k and v, each
// [batch, heads, seq, head_dim] contiguous: the layout the attention matmuls read. What it
// replaces: the bias add of the projection, the copies that make q, k, v contiguous, and in
// the backward the zero-filled gradients of three slices, their sums and the bias reduction
// (one pass gathers dz and sums the bias gradient). Keeps nothing for backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace tempo {

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_split(const at::Tensor& z, const std::optional<at::Tensor>& bias,
                                                         int64_t heads);
// (dz, dbias): dbias is dz summed over batch and seq when bias_grad, else an empty tensor.
std::tuple<at::Tensor, at::Tensor> qkv_split_backward(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                      const at::Tensor& grad_v, bool bias_grad);

}  // namespace tempo
