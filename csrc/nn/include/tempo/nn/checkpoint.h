// Activation checkpointing for LibTorch (which has none): run `fn` without keeping its
// activations, and in backward run it again from its saved inputs, with the default CPU
// generator's state (and each CUDA device's that an input lives on) replayed, so dropout
// masks in the recompute equal the forward's. Gradients reach the inputs that require them
// and every parameter `fn` uses. Under create_graph=True the recompute keeps its graph, so
// the result is twice differentiable wherever `fn` is (a gradient penalty through it equals
// the non-checkpointed one); an op inside `fn` that refuses double backward raises its error.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace tempo::nn {

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs);

}  // namespace tempo::nn
