// C++ API of tempo's causal linear attention over a chunk with carried prefix-sum states
// (SLiM). qf, kf: feature-mapped queries and keys [..., C, M] (non-negative, e.g. relu, elu+1,
// sqr or FAVOR+ features); v: [..., C, D]; the state (num [..., M, D], den [..., M]) is the sum
// of k v^T and of k over everything before the chunk (absent: zeros). Returns y [..., C, D],
// y_l = S_l^T q_l / (z_l . q_l + eps) with S_l, z_l the sums up to and including position l,
// and the state after the chunk. States are float32 (float64 for float64 data).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace tempo {

// mode "iterative": tempo's kernels, which walk the chunk keeping only the running sums and
// save only the inputs for backward (the backward rebuilds the sums by subtraction);
// "prefix": torch ops over a cumulative sum of k v^T (the C x M x D tensor), faster for small
// chunks and kept by autograd in full. Both differentiate q, k, v and the state in.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_linear_attention(
    const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& v, const std::optional<at::Tensor>& num = {},
    const std::optional<at::Tensor>& den = {}, double eps = 1e-6, c10::string_view mode = "iterative");

// The iterative mode's ops: forward -> (y, num_out, den_out); backward -> (grad_qf, grad_kf,
// grad_v, grad_num, grad_den) from the forward's inputs (grad_num, grad_den undefined without
// a state in).
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_linear_attention_forward(
    const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& v, const std::optional<at::Tensor>& num,
    const std::optional<at::Tensor>& den, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_linear_attention_backward(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_num, const std::optional<at::Tensor>& grad_den,
    const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& v, const std::optional<at::Tensor>& num,
    const std::optional<at::Tensor>& den, double eps);

}  // namespace tempo
