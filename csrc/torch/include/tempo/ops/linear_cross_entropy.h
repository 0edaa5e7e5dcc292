// C++ API of tempo's fused LM head and loss: cross_entropy(linear(hidden, weight, bias), labels)
// computed over chunks of rows, keeping no logits for backward (the backward recomputes each
// chunk's logits from hidden, and their softmax in place). The logits of a step (S x V
// per sequence, 206 MB for GPT-2 at S = 1024) are never all in memory, forward or backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace tempo {

// hidden [..., H]; weight [V, H]; bias [V] or none; labels [...] int64 in [0, V) or
// ignore_index. reduction "mean" (over the rows not ignored; 0, not NaN, when all are
// ignored), "sum" or "none" (the per-row losses, shape of labels, 0 where ignored).
// label_smoothing as torch's cross_entropy. chunk: rows per chunk (0: about 32 MiB of fp32
// logits per chunk). A label outside [0, V) that is not ignore_index: an error naming it.
// dtype: the loss's (default hidden's; float32 from 16-bit data gives the loss unrounded, as
// autocast's cross_entropy does: the logits are formed in the data's dtype and reduced in fp32).
// logit_scale, softcap: what the model does to its logits before the loss, z' = softcap
// tanh(logit_scale z / softcap) (Gemma 2/3's final_logit_softcapping; Cohere's logit_scale,
// Granite's 1 / logits_scaling), the gradient through both. z_loss: z_loss lse^2 added to each
// row's loss (not to ignored rows), lse the log-sum-exp of z'.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const at::Tensor& labels,
                                int64_t ignore_index = -100, double label_smoothing = 0.0,
                                c10::string_view reduction = "mean", int64_t chunk = 0,
                                std::optional<at::ScalarType> dtype = std::nullopt, double logit_scale = 1.0,
                                std::optional<double> softcap = std::nullopt, double z_loss = 0.0);

// The ops behind it: forward -> (loss, lse [N] float32, float64 for float64 data), backward -> (grad_hidden,
// grad_weight, grad_bias (undefined without a bias)). The backward's softmax is exp(logits - lse) on
// CUDA; on the CPU it is ATen's softmax kernel on the recomputed logits (lse's shape is checked),
// since at::exp there (MKL's VML) was seen to give one tensor other last bits from call to call.
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels,
    int64_t ignore_index, double label_smoothing, c10::string_view reduction, int64_t chunk,
    std::optional<at::ScalarType> dtype = std::nullopt, double logit_scale = 1.0,
    std::optional<double> softcap = std::nullopt, double z_loss = 0.0);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, const at::Tensor& lse, int64_t ignore_index, double label_smoothing,
    c10::string_view reduction, int64_t chunk, double logit_scale = 1.0, std::optional<double> softcap = std::nullopt,
    double z_loss = 0.0);

// Per-token statistics from the same chunks and logit transforms, no logits kept, no gradient
// (a trainer's diagnostics and RL's per-token terms): (the log-probability of each label, 0 where
// ignored; the entropy of softmax(z' / temperature), every row; whether the label is the arg max,
// false where ignored), each of the labels' shape, in the math type (bool for the last).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_stats(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels,
    int64_t ignore_index = -100, double temperature = 1.0, double logit_scale = 1.0,
    std::optional<double> softcap = std::nullopt, int64_t chunk = 0);

}  // namespace tempo
