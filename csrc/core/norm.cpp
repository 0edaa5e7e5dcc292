// Backend-independent parts of the norms: names, validation, workspace size.
#include "tempo/norm.h"

#include <algorithm>

namespace tempo {

const char* norm_name(NormKind kind) {
  switch (kind) {
    case NormKind::kLayerNorm: return "layer_norm";
    case NormKind::kRmsNorm: return "rms_norm";
  }
  return "unknown";
}

// The CUDA backward runs at most this many row groups, each writing one partial row.
int64_t norm_backward_workspace_elems(int64_t rows, int64_t cols) {
  const int64_t groups = std::min<int64_t>(std::max<int64_t>(rows, 1), 512);
  return groups * cols * 3;  // weight, bias and pre-bias partials
}

namespace detail {

namespace {
bool known(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kBFloat16 || d == DType::kFloat16;
}
bool known(NormKind k) { return k == NormKind::kLayerNorm || k == NormKind::kRmsNorm; }

Status check_prologue(bool enabled, const NormPrologue& pr, NormKind kind, const uint8_t* mask, const char* what) {
  if (!enabled) return Status::Ok();
  const std::string w(what);
  TEMPO_CORE_CHECK(kind == NormKind::kLayerNorm, w + ": the bias-dropout-residual prologue needs LayerNorm");
  TEMPO_CORE_CHECK(pr.p >= 0.0 && pr.p <= 1.0, w + ": dropout p must be in [0, 1]");
  TEMPO_CORE_CHECK(pr.mode == DropoutMode::kBits || pr.mode == DropoutMode::kPhilox, w + ": unknown dropout mode");
  if (pr.p > 0.0 && pr.mode == DropoutMode::kBits)
    TEMPO_CORE_CHECK(mask != nullptr, w + ": bits-mode dropout needs the mask");
  return Status::Ok();
}
}  // namespace

Status validate(const NormForwardParams& p) {
  TEMPO_CORE_CHECK(known(p.kind), "norm forward: unknown norm");
  TEMPO_CORE_CHECK(known(p.dtype), "norm forward: unsupported dtype");
  TEMPO_CORE_CHECK(p.rows >= 0 && p.cols >= 0, "norm forward: rows and cols must be non-negative");
  TEMPO_CORE_CHECK(p.eps >= 0.0, "norm forward: eps must be non-negative");
  TEMPO_CORE_CHECK(p.kind == NormKind::kLayerNorm || !p.bias, "norm forward: rms_norm has no bias");
  if (p.rows * p.cols == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.x && p.y && p.rstd, "norm forward: x, y and rstd must be non-null");
  return check_prologue(p.prologue.residual != nullptr, p.prologue, p.kind, p.mask, "norm forward");
}

Status validate(const NormBackwardParams& p) {
  TEMPO_CORE_CHECK(known(p.kind), "norm backward: unknown norm");
  TEMPO_CORE_CHECK(known(p.dtype), "norm backward: unsupported dtype");
  TEMPO_CORE_CHECK(p.rows >= 0 && p.cols >= 0, "norm backward: rows and cols must be non-negative");
  TEMPO_CORE_CHECK(p.kind == NormKind::kLayerNorm || !p.bias, "norm backward: rms_norm has no bias");
  if (p.rows * p.cols == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.grad_y && p.y && p.rstd && p.grad_x, "norm backward: grad_y, y, rstd and grad_x must be non-null");
  TEMPO_CORE_CHECK(!p.weight || p.grad_weight, "norm backward: grad_weight must be non-null when weight is");
  TEMPO_CORE_CHECK(!p.bias || p.grad_bias, "norm backward: grad_bias must be non-null when bias is");
  TEMPO_CORE_CHECK(p.grad_residual || !p.grad_pre_bias, "norm backward: grad_pre_bias needs grad_residual");
  return check_prologue(p.grad_residual != nullptr, p.prologue, p.kind, p.mask, "norm backward");
}

}  // namespace detail
}  // namespace tempo
