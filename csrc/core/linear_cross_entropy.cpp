// Backend-independent parts of linear_cross_entropy's row passes: parameter validation.
#include "tempo/linear_cross_entropy.h"

#include <cmath>
#include <string>

namespace tempo::detail {

namespace {
Status check_common(const LinearCrossEntropyParams& p, const std::string& w) {
  TEMPO_CORE_CHECK(p.dtype == DType::kFloat32 || p.dtype == DType::kFloat64 || p.dtype == DType::kBFloat16 ||
                       p.dtype == DType::kFloat16,
                   w + ": unsupported dtype");
  TEMPO_CORE_CHECK(p.rows >= 0, w + ": rows must be non-negative");
  TEMPO_CORE_CHECK(p.vocab > 0, w + ": the vocabulary must be non-empty");
  TEMPO_CORE_CHECK(numel_fits({p.rows, p.vocab}), w + ": the sizes are too large");
  TEMPO_CORE_CHECK(std::isfinite(p.smoothing) && p.smoothing >= 0.0 && p.smoothing <= 1.0,
                   w + ": the label smoothing must be in [0, 1]");
  if (p.rows > 0) TEMPO_CORE_CHECK(p.labels, w + ": labels must be non-null");
  return Status::Ok();
}
}  // namespace

Status validate(const LinearCrossEntropyForwardParams& p) {
  const std::string w = "linear cross entropy forward";
  Status s = check_common(p, w);
  if (!s.ok() || p.rows == 0) return s;
  TEMPO_CORE_CHECK(p.logits && p.lse && p.loss, w + ": logits, lse and loss must be non-null");
  return Status::Ok();
}

Status validate(const LinearCrossEntropyBackwardParams& p) {
  const std::string w = "linear cross entropy backward";
  Status s = check_common(p, w);
  if (!s.ok() || p.rows == 0) return s;
  TEMPO_CORE_CHECK(p.logits && p.lse && p.scale, w + ": logits, lse and scale must be non-null");
  return Status::Ok();
}

}  // namespace tempo::detail

namespace tempo {
TEMPO_CUDA_UNAVAILABLE(linear_cross_entropy_forward_cuda, LinearCrossEntropyForwardParams,
                       "linear cross entropy forward")
TEMPO_CUDA_UNAVAILABLE(linear_cross_entropy_backward_cuda, LinearCrossEntropyBackwardParams,
                       "linear cross entropy backward")
}  // namespace tempo
