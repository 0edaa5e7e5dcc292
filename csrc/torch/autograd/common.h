// Internal to the autograd kernels: what a tempo backward returns under create_graph=True.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace tempo::autograd_impl {

// Marks the gradients `grads` that a tempo backward computed (without recording it) as
// differentiable in name only: differentiating them again raises an error naming `op`. The
// refusal is a node of the graph whose edges lead to the forward's inputs (the edges of the
// node now running) and to the incoming gradients `grads_in`, so every differentiation that
// would need the second derivative reaches and runs it, including torch.autograd.grad with
// inputs= and allow_unused=True (torch.autograd.functional.hessian, jacobian, hvp), which
// would otherwise prune an unconnected node and read its None as zeros.
void refuse_double_backward(const char* op, const torch::autograd::variable_list& grads_in,
                            torch::autograd::variable_list& grads);

// Runs a backward body `f` (returning the input gradients) without recording it; under
// create_graph=True the result is refused for a second differentiation, as above. The
// backward reads y and what the forward kept, not x, so the second derivative would need x;
// torch's own op gives it.
template <typename F>
torch::autograd::variable_list once_differentiable(const char* op, const torch::autograd::variable_list& grads_in,
                                                   F&& f) {
  const bool create_graph = at::GradMode::is_enabled();
  torch::autograd::variable_list grads;
  {
    at::NoGradGuard no_grad;
    grads = f();
  }
  if (create_graph) refuse_double_backward(op, grads_in, grads);
  return grads;
}

// What a Function saves of its own output: a detached alias (the same storage and version
// counter, so an in-place edit before the backward is still caught). Saved as the output itself,
// under a saved-tensor hook that keeps what it packs (non-reentrant activation checkpointing
// stores the recomputed tensors), the output would reference its own grad_fn from inside that
// node, a cycle through C++ nodes Python's collector cannot see: every checkpointed step leaked
// its recomputed outputs (13 MB a step on MiniLM at S 64).
inline at::Tensor saved_output(const at::Tensor& y) {
  at::Tensor alias = y.detach();
  // (a Function's forward runs below the ADInplaceOrView key, where detach does not share the
  // version counter: shared here, so that editing the output in place still raises in backward)
  alias.unsafeGetTensorImpl()->set_version_counter(y.unsafeGetTensorImpl()->version_counter());
  return alias;
}

}  // namespace tempo::autograd_impl
