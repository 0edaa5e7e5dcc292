// Backend-independent parts of causal linear attention: parameter validation.
#include "tempo/linear_attention.h"

#include <cmath>
#include <string>

namespace tempo::detail {

namespace {
// What both directions check: dtype, sizes, eps, the state in as a pair.
Status check_inputs(const LinearAttentionInputs& p, const std::string& w) {
  TEMPO_CORE_CHECK(p.dtype == DType::kFloat32 || p.dtype == DType::kFloat64 || p.dtype == DType::kBFloat16 ||
                       p.dtype == DType::kFloat16,
                   w + ": unsupported dtype");
  TEMPO_CORE_CHECK(p.rows >= 0 && p.len >= 0, w + ": rows and len must be non-negative");
  TEMPO_CORE_CHECK(p.m > 0 && p.d > 0, w + ": the feature size m and the value size d must be positive");
  TEMPO_CORE_CHECK(
      numel_fits({p.rows, p.len, p.m}) && numel_fits({p.rows, p.len, p.d}) && numel_fits({p.rows, p.m, p.d}),
      w + ": the sizes are too large");
  TEMPO_CORE_CHECK(std::isfinite(p.eps) && p.eps >= 0.0, w + ": eps must be finite and >= 0");
  TEMPO_CORE_CHECK((p.num_in == nullptr) == (p.den_in == nullptr),
                   w + ": num_in and den_in come together (both or neither)");
  if (p.rows > 0 && p.len > 0) TEMPO_CORE_CHECK(p.q && p.k && p.v, w + ": q, k and v must be non-null");
  return Status::Ok();
}
}  // namespace

Status validate(const LinearAttentionForwardParams& p) {
  const std::string w = "causal linear attention forward";
  Status s = check_inputs(p, w);
  if (!s.ok() || p.rows == 0) return s;
  TEMPO_CORE_CHECK(p.num_out && p.den_out, w + ": num_out and den_out must be non-null");
  if (p.len > 0) TEMPO_CORE_CHECK(p.y, w + ": y must be non-null");
  return Status::Ok();
}

Status validate(const LinearAttentionBackwardParams& p) {
  const std::string w = "causal linear attention backward";
  Status s = check_inputs(p, w);
  if (!s.ok() || p.rows == 0) return s;
  TEMPO_CORE_CHECK(p.grad_num_in && p.grad_den_in, w + ": grad_num_in and grad_den_in must be non-null");
  if (p.len > 0)
    TEMPO_CORE_CHECK(p.grad_y && p.grad_q && p.grad_k && p.grad_v, w + ": grad_y and the gradients must be non-null");
  return Status::Ok();
}

}  // namespace tempo::detail

namespace tempo {
TEMPO_CUDA_UNAVAILABLE(linear_attention_forward_cuda, LinearAttentionForwardParams, "causal linear attention forward")
TEMPO_CUDA_UNAVAILABLE(linear_attention_backward_cuda, LinearAttentionBackwardParams,
                       "causal linear attention backward")
}  // namespace tempo
