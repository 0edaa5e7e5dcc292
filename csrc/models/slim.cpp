#include "tempo/models/slim.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>

namespace tempo::slim {

using tempo::models::LayerStates;
using tempo::models::PerformerBlockImpl;
using tempo::models::PerformerLM;

namespace {
const char* kOp = "tempo::slim";

void check(PerformerLM& model, const at::Tensor& tokens, std::optional<int64_t> chunk, const at::Tensor& weight) {
  TORCH_CHECK(
      tokens.defined() && tokens.dim() == 2 && (tokens.scalar_type() == at::kLong || tokens.scalar_type() == at::kInt),
      kOp, ": tokens must be an integer tensor [batch, length] (int64 or int32)");
  TORCH_CHECK(tokens.size(1) >= 2, kOp, ": the sequence needs at least 2 tokens (an input and a target), got ",
              tokens.size(1));
  TORCH_CHECK(tokens.size(0) >= 1, kOp, ": the batch is empty");
  const int64_t vocab = model->config().vocab;
  const int64_t lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < vocab, kOp, ": token ids must be in [0, ", vocab, "), got [", lo, ", ", hi, "]");
  TORCH_CHECK(tokens.size(1) - 1 <= model->config().max_len, kOp, ": ", tokens.size(1) - 1,
              " input positions exceed the model's max_len ", model->config().max_len);
  TORCH_CHECK(!chunk.has_value() || *chunk > 0, kOp, ": chunk must be positive (or none: the whole sequence), got ",
              chunk.value_or(0));
  TORCH_CHECK(!weight.defined() ||
                  (weight.dim() == 2 && weight.size(0) == tokens.size(0) && weight.size(1) == tokens.size(1) - 1),
              kOp, ": loss_weight must be [batch, length - 1] (one per target), got ",
              weight.defined() ? weight.sizes() : at::IntArrayRef{});
  if (weight.defined() && weight.numel() > 0) {  // else a NaN or a negative loss, silently
    const at::Tensor w = weight.to(at::kDouble);
    TORCH_CHECK(at::isfinite(w).all().item<bool>() && w.min().item<double>() >= 0, kOp,
                ": loss_weight must be finite and >= 0 (0 drops a target), got values in [", w.min().item<double>(),
                ", ", w.max().item<double>(), "]");
  }
}

at::Tensor weights_of(const at::Tensor& loss_weight, const at::Tensor& targets) {
  return loss_weight.defined() ? loss_weight.to(at::kFloat)
                               : at::ones(targets.sizes(), targets.options().dtype(at::kFloat));
}

// Summed cross-entropy of the chunk's targets, each weighted (0 drops a position).
at::Tensor chunk_loss(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weight) {
  const at::Tensor l = logits.scalar_type() == at::kDouble ? logits : logits.to(at::kFloat);
  const at::Tensor ce =
      at::cross_entropy_loss(l.flatten(0, 1), targets.flatten().to(at::kLong), std::nullopt, at::Reduction::None);
  return (ce * weight.flatten().to(ce.scalar_type())).sum();
}

std::vector<at::Tensor> trainable(PerformerLM& model) {
  std::vector<at::Tensor> ps;
  for (const auto& p : model->parameters())
    if (p.requires_grad()) ps.push_back(p);
  return ps;
}

at::Tensor flat_grads(PerformerLM& model) {
  std::vector<at::Tensor> gs;
  for (const auto& p : trainable(model))
    gs.push_back(p.grad().defined() ? p.grad().flatten().to(at::kDouble) : at::zeros({p.numel()}, at::kDouble));
  return at::cat(gs);
}

void zero_grads(PerformerLM& model) {
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
}
}  // namespace

at::Tensor full_loss_and_backward(PerformerLM& model, const at::Tensor& tokens, const at::Tensor& loss_weight) {
  check(model, tokens, std::nullopt, loss_weight);
  const int64_t L = tokens.size(1) - 1;
  const at::Tensor inputs = tokens.narrow(1, 0, L), targets = tokens.narrow(1, 1, L);
  const at::Tensor weight = weights_of(loss_weight, targets);
  const at::Tensor logits = std::get<0>(model->forward_chunk(inputs));
  const at::Tensor loss = chunk_loss(logits, targets, weight) / weight.sum().clamp_min(1);
  loss.backward();
  return loss.detach().to(model->head->weight.scalar_type());
}

at::Tensor loss_and_backward(PerformerLM& model, const at::Tensor& tokens, std::optional<int64_t> chunk_,
                             const at::Tensor& loss_weight) {
  check(model, tokens, chunk_, loss_weight);
  const int64_t L = tokens.size(1) - 1;
  const at::Tensor inputs = tokens.narrow(1, 0, L), targets = tokens.narrow(1, 1, L);
  const at::Tensor weight = weights_of(loss_weight, targets);
  const int64_t chunk = std::min(chunk_.value_or(L), L);
  const at::Tensor total = weight.sum().clamp_min(1);
  std::vector<int64_t> starts;
  for (int64_t s = 0; s < L; s += chunk) starts.push_back(s);
  auto span = [&](const at::Tensor& t, int64_t s) { return t.narrow(1, s, std::min(chunk, L - s)); };
  const size_t layers = model->blocks->size();

  // Forward without a graph up to the last chunk: each layer's state before it, and the loss
  // so far (the last chunk's forward is the backward's first recomputation).
  LayerStates states(layers);
  at::Tensor loss = at::zeros({}, tokens.options().dtype(at::kDouble));
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i + 1 < starts.size(); ++i) {
      auto [logits, next] = model->forward_chunk(span(inputs, starts[i]), starts[i], i ? states : LayerStates{});
      states = next;
      loss += chunk_loss(logits, span(targets, starts[i]), span(weight, starts[i])).to(at::kDouble);
    }
  }
  // Backward over the chunks in reverse, carrying the states and their gradients.
  const std::vector<at::Tensor> params = trainable(model);
  LayerStates grads(layers);
  // bf16/fp16 parameters: each chunk's gradient is summed in float32 and rounded into grad()
  // once at the end, as full backpropagation rounds each parameter's gradient once (summed in
  // grad()'s own dtype, one rounding per chunk: 6.8x full backprop's error at chunk 1).
  const bool low = std::any_of(params.begin(), params.end(), [](const at::Tensor& p) {
    return p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf;
  });
  std::vector<at::Tensor> sums;
  if (low)
    for (const auto& p : params)
      sums.push_back(
          at::zeros(p.sizes(), p.options().dtype(p.scalar_type() == at::kDouble ? at::kDouble : at::kFloat)));
  for (size_t i = starts.size(); i-- > 0;) {
    const int64_t s = starts[i];
    const bool first = i == 0, last = i + 1 == starts.size();
    at::Tensor x = model->embed_chunk(span(inputs, s), s);
    LayerStates before(layers), after(layers);
    for (size_t r = 0; r < layers; ++r) {
      auto* block = model->blocks[r]->as<PerformerBlockImpl>();
      if (first) {  // the sequence's start: zeros, nothing to rebuild
        std::tie(x, after[r]) = block->forward(x);
      } else if (last) {  // the forward stopped before this chunk: its state is the one before
        before[r] = {states[r].num.detach().requires_grad_(), states[r].den.detach().requires_grad_()};
        std::tie(x, after[r]) = block->forward(x, before[r]);
      } else {  // the state before the chunk: the state after it minus the chunk's own sums
        std::tie(x, after[r], before[r]) = block->forward_rebuilding(x, states[r]);
      }
      states[r] = before[r].defined() ? tempo::nn::LinearAttentionState{before[r].num.detach(), before[r].den.detach()}
                                      : tempo::nn::LinearAttentionState{};
    }
    const at::Tensor this_loss = chunk_loss(model->logits(x), span(targets, s), span(weight, s));
    if (last) loss += this_loss.detach().to(at::kDouble);
    at::Tensor phi = this_loss / total;
    for (size_t r = 0; r < layers; ++r)  // the surrogate: <G_r, state_r after the chunk>
      if (grads[r].defined()) phi = phi + (after[r].num * grads[r].num).sum() + (after[r].den * grads[r].den).sum();
    std::vector<at::Tensor> inputs_ = params;
    for (const auto& b : before)
      if (b.defined()) inputs_.push_back(b.num), inputs_.push_back(b.den);
    if (low) {
      const auto got = torch::autograd::grad({phi}, inputs_, {}, false, false, /*allow_unused=*/true);
      for (size_t k = 0; k < params.size(); ++k)
        if (got[k].defined()) sums[k].add_(got[k]);
      size_t k = params.size();  // the leaves follow the parameters, two per layer that has them
      for (size_t r = 0; r < layers; ++r) {
        grads[r] = tempo::nn::LinearAttentionState{};
        if (before[r].defined()) grads[r] = {got[k], got[k + 1]}, k += 2;
      }
      continue;
    }
    // Accumulates into the parameters' grad (as full backpropagation would) and the leaves'.
    torch::autograd::backward({phi}, {}, std::nullopt, false, inputs_);
    for (size_t r = 0; r < layers; ++r)
      grads[r] = before[r].defined() ? tempo::nn::LinearAttentionState{before[r].num.grad(), before[r].den.grad()}
                                     : tempo::nn::LinearAttentionState{};
  }
  if (low)
    for (size_t k = 0; k < params.size(); ++k) {
      at::Tensor p = params[k];
      p.mutable_grad() = (p.grad().defined() ? sums[k] + p.grad() : sums[k]).to(p.scalar_type());
    }
  return (loss / total).to(model->head->weight.scalar_type());
}

Discrepancy gradient_discrepancy(PerformerLM& model, const at::Tensor& tokens, std::optional<int64_t> chunk,
                                 const at::Tensor& loss_weight) {
  Discrepancy d;
  zero_grads(model);
  d.full_loss = full_loss_and_backward(model, tokens, loss_weight).item<double>();
  const at::Tensor ref = flat_grads(model);
  zero_grads(model);
  d.chunked_loss = loss_and_backward(model, tokens, chunk, loss_weight).item<double>();
  const at::Tensor got = flat_grads(model);
  zero_grads(model);
  d.grad_rel = ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item<double>();
  return d;
}

}  // namespace tempo::slim
