// AdamW with a reproducible CPU update: the trainer's optimizer.
//
// torch::optim::AdamW takes the square root of the second moment with at::sqrt, which on the
// CPU (float, double) ATen hands to MKL's VML. VML's square root is not correctly rounded (about
// 0.6% of float results are 1 ulp from IEEE's) and, inside `tempo train`, it now and then gave
// different bits for the same input, so that two identical runs drifted apart. This class is
// torch::optim::AdamW with step() replaced: on the CPU, one pass over each parameter with IEEE
// square roots (std::sqrt), element by element, so a step gives the same bits on every run and
// for any thread count; elsewhere (CUDA, reduced-precision parameters) the same update in
// tensor ops. Options, state (AdamWParamState) and save/load are torch's, so checkpoints of
// either class load into the other.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/adamw.h>

namespace tempo::train {

class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  at::Tensor step(LossClosure closure = nullptr) override;
};

// One AdamW update (the `step`-th, counting from 1) of `param` in place, with its moments
// `exp_avg` and `exp_avg_sq` (and `max_exp_avg_sq` when defined: amsgrad):
//   param *= 1 - lr * weight_decay
//   exp_avg = beta1 * exp_avg + (1 - beta1) * grad
//   exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2    (max_exp_avg_sq = max(itself, exp_avg_sq))
//   param -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)
// All tensors on one device, of the parameter's shape and dtype; clear errors otherwise.
void adamw_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t step, double lr, double beta1,
                  double beta2, double eps, double weight_decay);

}  // namespace tempo::train
