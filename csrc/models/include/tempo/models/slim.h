// SLiM (NeurIPS 2021): training a PerformerLM on a long sequence in memory that does not grow
// with its length, with the gradients of full backpropagation (docs/slim.md).
//
// loss_and_backward runs the sequence in chunks twice: a forward without a graph that carries
// each layer's prefix-sum state up to the last chunk, then a backward over the chunks in
// reverse. For each chunk it rebuilds every layer's state before the chunk by subtracting the
// chunk's own sums from the state after it, recomputes the chunk with autograd from those
// states (leaves), and back-propagates the chunk's loss plus the surrogate
// sum_r <G_r, state_r after the chunk>, G_r being the gradient that reached that state from
// later chunks. Memory: one chunk's activations and one state per layer.
#pragma once

#include <optional>

#include "tempo/models/performer.h"

namespace tempo::slim {

// The mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (each target
// weighted by loss_weight [B, L - 1] if defined), its gradient accumulated into the
// parameters' grad, computed in chunks of `chunk` positions (nullopt: one chunk). Returns the
// loss (a detached scalar of the model's dtype). Clear errors for chunk <= 0, fewer than 2
// tokens, token ids outside the vocabulary, more positions than the model's max_len, or loss
// weights of another shape, not finite or negative.
at::Tensor loss_and_backward(tempo::models::PerformerLM& model, const at::Tensor& tokens, std::optional<int64_t> chunk,
                             const at::Tensor& loss_weight = {});

// The reference: one forward and one backward over the whole sequence, same loss.
at::Tensor full_loss_and_backward(tempo::models::PerformerLM& model, const at::Tensor& tokens,
                                  const at::Tensor& loss_weight = {});

struct Discrepancy {
  double grad_rel = 0;  // ||g_chunked - g_full|| / ||g_full|| over all parameters
  double full_loss = 0, chunked_loss = 0;
};
// Both, from zeroed gradients (left zeroed after).
Discrepancy gradient_discrepancy(tempo::models::PerformerLM& model, const at::Tensor& tokens,
                                 std::optional<int64_t> chunk, const at::Tensor& loss_weight = {});

}  // namespace tempo::slim
