// C++ API of tempo's attention: softmax(scale q k^T + mask) v for [B, A, S, d] inputs with
// an optional additive or boolean mask (broadcast to [B, A, Sq, Sk]; boolean: true attends),
// the causal mask, and dropout of the probabilities. The backward keeps q, k, v, P and the
// dropout bits ("bits") or Philox state ("philox"): never the logits, never the dropped
// probabilities (recomputed from P and the bits), never a byte mask. Rows whose every key is
// masked give zeros (torch's softmax gives NaN there).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace tempo {

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& attn_mask = std::nullopt, double dropout_p = 0.0,
                     bool causal = false, std::optional<double> scale = std::nullopt, c10::string_view mode = "bits");

// (out, P, keep): keep is the dropout's bits or state (see dropout_forward), empty for p = 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v,
                                                                 const std::optional<at::Tensor>& attn_mask,
                                                                 double dropout_p, bool causal,
                                                                 std::optional<double> scale, c10::string_view mode);
// (dq, dk, dv)
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& grad, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& probs, const at::Tensor& keep,
                                                                  double dropout_p, std::optional<double> scale,
                                                                  c10::string_view mode);

}  // namespace tempo
