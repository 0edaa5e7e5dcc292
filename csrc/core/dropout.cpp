// Backend-independent parts of dropout: parameter validation.
#include "tempo/dropout.h"

#include <string>

namespace tempo::detail {

namespace {
bool known(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kBFloat16 || d == DType::kFloat16;
}
}  // namespace

Status check_dropout_mask(DropoutMode mode, double p, const void* mask, const char* what) {
  const std::string w(what);
  TEMPO_CORE_CHECK(mode == DropoutMode::kBits || mode == DropoutMode::kPhilox, w + ": unknown dropout mode");
  if (mode == DropoutMode::kPhilox)
    TEMPO_CORE_CHECK(!mask, w + ": philox mode takes no mask (the bits are drawn)");
  else if (p > 0.0)
    TEMPO_CORE_CHECK(mask, w + ": bits mode needs the mask");
  return Status::Ok();
}

Status validate(const DropoutForwardParams& p) {
  TEMPO_CORE_CHECK(known(p.dtype), "dropout forward: unsupported dtype");
  TEMPO_CORE_CHECK(p.p >= 0.0 && p.p <= 1.0, "dropout forward: p must be in [0, 1]");
  TEMPO_CORE_CHECK(p.numel >= 0, "dropout forward: numel must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({p.numel}), "dropout forward: numel is too large");
  if (p.numel == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.x && p.y, "dropout forward: x and y must be non-null");
  return check_dropout_mask(p.mode, p.p, p.mask, "dropout forward");
}

Status validate(const DropoutBackwardParams& p) {
  TEMPO_CORE_CHECK(known(p.dtype), "dropout backward: unsupported dtype");
  TEMPO_CORE_CHECK(p.p >= 0.0 && p.p <= 1.0, "dropout backward: p must be in [0, 1]");
  TEMPO_CORE_CHECK(p.numel >= 0, "dropout backward: numel must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({p.numel}), "dropout backward: numel is too large");
  if (p.numel == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.grad_y && p.grad_x, "dropout backward: grad_y and grad_x must be non-null");
  return check_dropout_mask(p.mode, p.p, p.mask, "dropout backward");
}

}  // namespace tempo::detail

namespace tempo {
TEMPO_CUDA_UNAVAILABLE(dropout_forward_cuda, DropoutForwardParams, "dropout forward")
TEMPO_CUDA_UNAVAILABLE(dropout_backward_cuda, DropoutBackwardParams, "dropout backward")
#if defined(TEMPO_WITH_CUDA) && !TEMPO_WITH_CUDA
Status philox_state_store_cuda(const PhiloxState&, uint64_t*, void*) {
  return Status::Error("philox state store: this build of tempo has no CUDA kernels");
}
#endif
}  // namespace tempo
