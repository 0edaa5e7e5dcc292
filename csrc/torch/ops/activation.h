// Internal to the torch layer: argument checks and the backend-independent kernel bodies
// of the activation ops, shared by the CPU, CUDA and Meta registrations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

#include "tempo/activation.h"

namespace tempo::torch_impl {

Activation gelu_kind(c10::string_view approximate, const char* op);

// Checks x and bias; returns the op's outputs, computed by the core (or only allocated
// when x is on the Meta device).
std::tuple<at::Tensor, at::Tensor> activation_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                                      Activation act, const char* op);
at::Tensor activation_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask, Activation act,
                               const char* op);

}  // namespace tempo::torch_impl
