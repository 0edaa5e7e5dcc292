// Backend-independent parts of the activation ops: names and parameter validation.
#include "tempo/activation.h"

#include <algorithm>

namespace tempo {

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::kGeluErf:
      return "gelu";
    case Activation::kGeluTanh:
      return "gelu(approximate='tanh')";
    case Activation::kSilu:
      return "silu";
  }
  return "unknown";
}

namespace {
bool known(Activation act) {
  return act == Activation::kGeluErf || act == Activation::kGeluTanh || act == Activation::kSilu;
}
bool known(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kBFloat16 || d == DType::kFloat16;
}
}  // namespace

int64_t activation_backward_workspace_elems(int64_t numel, int64_t bias_size) {
  if (bias_size <= 0) return 0;
  const int64_t rows = numel / bias_size;
  return std::min<int64_t>(std::max<int64_t>(rows, 1), kActivationBiasGroups) * bias_size;
}

namespace detail {

Status validate(const ActivationForwardParams& p) {
  TEMPO_CORE_CHECK(known(p.act), "activation forward: unknown activation");
  TEMPO_CORE_CHECK(known(p.dtype), "activation forward: unsupported dtype");
  TEMPO_CORE_CHECK(p.numel >= 0, "activation forward: numel must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({p.numel}), "activation forward: numel is too large");
  if (p.numel == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.x && p.y && p.mask, "activation forward: x, y and mask must be non-null");
  if (p.bias) {
    TEMPO_CORE_CHECK(p.bias_size > 0 && p.numel % p.bias_size == 0, "activation forward: bias_size must divide numel");
  }
  return Status::Ok();
}

Status validate(const ActivationBackwardParams& p) {
  TEMPO_CORE_CHECK(known(p.act), "activation backward: unknown activation");
  TEMPO_CORE_CHECK(known(p.dtype), "activation backward: unsupported dtype");
  TEMPO_CORE_CHECK(p.numel >= 0, "activation backward: numel must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({p.numel}), "activation backward: numel is too large");
  if (p.numel == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.y && p.mask && p.grad_y && p.grad_x,
                   "activation backward: y, mask, grad_y and grad_x must be non-null");
  if (p.grad_bias) {
    TEMPO_CORE_CHECK(p.bias_size > 0 && p.numel % p.bias_size == 0, "activation backward: bias_size must divide numel");
  }
  return Status::Ok();
}

}  // namespace detail

TEMPO_CUDA_UNAVAILABLE(activation_forward_cuda, ActivationForwardParams, "activation forward")
TEMPO_CUDA_UNAVAILABLE(activation_backward_cuda, ActivationBackwardParams, "activation backward")

}  // namespace tempo
