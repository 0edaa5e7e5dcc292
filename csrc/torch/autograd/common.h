// Internal to the autograd kernels: what a tempo backward returns under create_graph=True.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <string>
#include <vector>

namespace tempo::autograd_impl {

// Runs a backward body `f` (returning the input gradients) without recording it. Under
// create_graph=True the gradients come back differentiable in name only: differentiating
// them again raises an error naming `op` (as torch's once_differentiable and sdpa do), never
// a silent zero. The backward reads y and what the forward kept, not x, so the second
// derivative would need x; torch's own op gives it.
template <typename F>
torch::autograd::variable_list once_differentiable(const char* op, F&& f) {
  const bool create_graph = at::GradMode::is_enabled();
  torch::autograd::variable_list grads;
  {
    at::NoGradGuard no_grad;
    grads = f();
  }
  if (!create_graph) return grads;
  torch::autograd::variable_list in;
  std::vector<size_t> where;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    at::Tensor t = grads[i].detach();
    t.set_requires_grad(true);
    in.push_back(t);
    where.push_back(i);
  }
  if (in.empty()) return grads;
  const std::string msg = std::string(op) +
                          ": double backward (differentiating a gradient computed with create_graph=True) is not "
                          "supported: its backward keeps the output, not the input. Use the torch op for second "
                          "derivatives.";
  torch::autograd::DelayedError err(msg, static_cast<int64_t>(in.size()));
  torch::autograd::variable_list out = err.apply(std::move(in));
  for (size_t k = 0; k < where.size(); ++k) grads[where[k]] = out[k];
  return grads;
}

}  // namespace tempo::autograd_impl
