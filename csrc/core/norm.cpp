// Backend-independent parts of the norms: names, validation, workspace size.
#include "tempo/norm.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "math/numeric.h"

namespace tempo {

const char* norm_name(NormKind kind) {
  switch (kind) {
    case NormKind::kLayerNorm:
      return "layer_norm";
    case NormKind::kRmsNorm:
      return "rms_norm";
  }
  return "unknown";
}

// Recovery errs by about u (|xhat| + |beta / gamma|): the ratio keeps u |beta / gamma| at
// 2^-20 (fp32) and 2^-43 (fp64), far inside the stated bounds (1e-5, 1e-12); in 16-bit the
// stated bound is a small multiple of torch's own error, which is already u, so beta may be
// at most |gamma| (see docs/accuracy.md for the measured errors).
double norm_recovery_ratio(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 16.0;
    case DType::kFloat64:
      return 1024.0;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 1.0;
  }
  return 0.0;
}

double norm_gamma_min(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kBFloat16:
      return static_cast<double>(std::numeric_limits<float>::min());
    case DType::kFloat64:
      return std::numeric_limits<double>::min();
    case DType::kFloat16:
      return 6.103515625e-05;  // 2^-14
  }
  return 0.0;
}

bool norm_column_recoverable(DType dtype, double gamma, double beta) {
  if (!std::isfinite(gamma) || !std::isfinite(beta)) return false;
  const double g = std::fabs(gamma);
  return g >= norm_gamma_min(dtype) && std::fabs(beta) <= norm_recovery_ratio(dtype) * g;
}

namespace {
template <typename T>
double param_at(const void* p, int64_t j, double absent) {
  return p ? static_cast<double>(math::to_float(static_cast<const T*>(p)[j])) : absent;
}
template <typename P>
int64_t kept_columns(DType dtype, const void* weight, const void* bias, int64_t cols, int64_t* out) {
  int64_t k = 0;
  for (int64_t j = 0; j < cols; ++j)
    if (!norm_column_recoverable(dtype, param_at<P>(weight, j, 1.0), param_at<P>(bias, j, 0.0))) out[k++] = j;
  return k;
}

// P: the parameters' type.
template <typename P>
Status check_kept(const NormBackwardParams& p) {
  for (int64_t j = 0; j < p.cols; ++j) {
    if (p.kept > 0 && p.kept_slot[j] >= 0) continue;
    const double g = param_at<P>(p.weight, j, 1.0), b = param_at<P>(p.beta, j, 0.0);
    if (!norm_column_recoverable(p.dtype, g, b))
      return Status::Error("norm backward: column " + std::to_string(j) + " (gamma " + std::to_string(g) + ", beta " +
                           std::to_string(b) + ") cannot be recovered from y; pass the forward's kept columns " +
                           "(norm_kept_columns) and their xhat");
  }
  return Status::Ok();
}
}  // namespace

namespace detail {
Status check_kept_columns(const NormBackwardParams& p) {
  switch (p.float_params ? DType::kFloat32 : p.dtype) {
    case DType::kFloat32:
      return check_kept<float>(p);
    case DType::kFloat64:
      return check_kept<double>(p);
    case DType::kBFloat16:
      return check_kept<math::bf16_t>(p);
    case DType::kFloat16:
      return check_kept<math::fp16_t>(p);
  }
  return Status::Ok();
}
}  // namespace detail

int64_t norm_kept_columns(DType dtype, DType param_dtype, const void* weight, const void* bias, int64_t cols,
                          int64_t* out) {
  switch (param_dtype) {
    case DType::kFloat32:
      return kept_columns<float>(dtype, weight, bias, cols, out);
    case DType::kFloat64:
      return kept_columns<double>(dtype, weight, bias, cols, out);
    case DType::kBFloat16:
      return kept_columns<math::bf16_t>(dtype, weight, bias, cols, out);
    case DType::kFloat16:
      return kept_columns<math::fp16_t>(dtype, weight, bias, cols, out);
  }
  return 0;
}

int64_t norm_backward_workspace_elems(int64_t rows, int64_t cols) {
  const int64_t groups = std::min<int64_t>(std::max<int64_t>(rows, 1), kNormBackwardGroups);
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
  return check_dropout_mask(pr.mode, pr.p, mask, what);
}
}  // namespace

Status validate(const NormForwardParams& p) {
  TEMPO_CORE_CHECK(known(p.kind), "norm forward: unknown norm");
  TEMPO_CORE_CHECK(known(p.dtype), "norm forward: unsupported dtype");
  TEMPO_CORE_CHECK(p.rows >= 0 && p.cols >= 0, "norm forward: rows and cols must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({p.rows, p.cols}), "norm forward: rows x cols is too large");
  TEMPO_CORE_CHECK(std::isfinite(p.eps) && p.eps >= 0.0, "norm forward: eps must be finite and non-negative");
  TEMPO_CORE_CHECK(p.kind == NormKind::kLayerNorm || !p.beta, "norm forward: rms_norm has no bias");
  TEMPO_CORE_CHECK(p.kept >= 0 && p.kept <= p.cols, "norm forward: kept columns must be in [0, cols]");
  TEMPO_CORE_CHECK(!p.float_params || p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16,
                   "norm forward: float32 parameters need bfloat16 or float16 data");
  if (p.rows * p.cols == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.x && p.y && p.rstd, "norm forward: x, y and rstd must be non-null");
  TEMPO_CORE_CHECK(p.kept == 0 || (p.kept_slot && p.kept_xhat),
                   "norm forward: kept columns need kept_slot and kept_xhat");
  return check_prologue(p.prologue.residual != nullptr, p.prologue, p.kind, p.mask, "norm forward");
}

Status validate(const NormBackwardParams& p) {
  TEMPO_CORE_CHECK(known(p.kind), "norm backward: unknown norm");
  TEMPO_CORE_CHECK(known(p.dtype), "norm backward: unsupported dtype");
  TEMPO_CORE_CHECK(p.rows >= 0 && p.cols >= 0, "norm backward: rows and cols must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({p.rows, p.cols}), "norm backward: rows x cols is too large");
  TEMPO_CORE_CHECK(p.kind == NormKind::kLayerNorm || !p.beta, "norm backward: rms_norm has no bias");
  TEMPO_CORE_CHECK(p.kept >= 0 && p.kept <= p.cols, "norm backward: kept columns must be in [0, cols]");
  TEMPO_CORE_CHECK(!p.float_params || p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16,
                   "norm backward: float32 parameters need bfloat16 or float16 data");
  if (p.rows * p.cols == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.grad_y && p.y && p.rstd && p.grad_x, "norm backward: grad_y, y, rstd and grad_x must be non-null");
  TEMPO_CORE_CHECK(p.kept == 0 || (p.kept_slot && p.kept_xhat),
                   "norm backward: kept columns need kept_slot and kept_xhat");
  TEMPO_CORE_CHECK(!p.weight || p.grad_weight, "norm backward: grad_weight must be non-null when weight is");
  TEMPO_CORE_CHECK(!p.beta || p.grad_beta, "norm backward: grad_beta must be non-null when beta is");
  TEMPO_CORE_CHECK(p.grad_residual || !p.grad_bias, "norm backward: grad_bias needs grad_residual");
  return check_prologue(p.grad_residual != nullptr, p.prologue, p.kind, p.mask, "norm backward");
}

}  // namespace detail

TEMPO_CUDA_UNAVAILABLE(norm_forward_cuda, NormForwardParams, "norm forward")
TEMPO_CUDA_UNAVAILABLE(norm_backward_cuda, NormBackwardParams, "norm backward")

}  // namespace tempo
