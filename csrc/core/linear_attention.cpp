// Backend-independent parts of causal linear attention: parameter validation.
#include "tempo/linear_attention.h"

#include <cmath>
#include <string>

namespace tempo::detail {

namespace {
Status check_shape(DType dtype, int64_t rows, int64_t len, int64_t m, int64_t d, double eps, const char* what) {
  const std::string w(what);
  TEMPO_CORE_CHECK(dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kBFloat16 ||
                       dtype == DType::kFloat16,
                   w + ": unsupported dtype");
  TEMPO_CORE_CHECK(rows >= 0 && len >= 0, w + ": rows and len must be non-negative");
  TEMPO_CORE_CHECK(m > 0 && d > 0, w + ": the feature size m and the value size d must be positive");
  TEMPO_CORE_CHECK(std::isfinite(eps) && eps >= 0.0, w + ": eps must be finite and >= 0");
  return Status::Ok();
}
}  // namespace

Status validate(const LinearAttentionForwardParams& p) {
  const char* w = "causal linear attention forward";
  Status s = check_shape(p.dtype, p.rows, p.len, p.m, p.d, p.eps, w);
  if (!s.ok()) return s;
  TEMPO_CORE_CHECK((p.num_in == nullptr) == (p.den_in == nullptr),
                   std::string(w) + ": num_in and den_in come together (both or neither)");
  if (p.rows == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.num_out && p.den_out, std::string(w) + ": num_out and den_out must be non-null");
  if (p.len > 0) TEMPO_CORE_CHECK(p.q && p.k && p.v && p.y, std::string(w) + ": q, k, v and y must be non-null");
  return Status::Ok();
}

Status validate(const LinearAttentionBackwardParams& p) {
  const char* w = "causal linear attention backward";
  Status s = check_shape(p.dtype, p.rows, p.len, p.m, p.d, p.eps, w);
  if (!s.ok()) return s;
  TEMPO_CORE_CHECK((p.num_in == nullptr) == (p.den_in == nullptr),
                   std::string(w) + ": num_in and den_in come together (both or neither)");
  if (p.rows == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.grad_num_in && p.grad_den_in, std::string(w) + ": grad_num_in and grad_den_in must be non-null");
  if (p.len > 0)
    TEMPO_CORE_CHECK(p.q && p.k && p.v && p.grad_y && p.grad_q && p.grad_k && p.grad_v,
                     std::string(w) + ": q, k, v, grad_y and the gradients must be non-null");
  return Status::Ok();
}

}  // namespace tempo::detail

namespace tempo {
TEMPO_CUDA_UNAVAILABLE(linear_attention_forward_cuda, LinearAttentionForwardParams, "causal linear attention forward")
TEMPO_CUDA_UNAVAILABLE(linear_attention_backward_cuda, LinearAttentionBackwardParams, "causal linear attention backward")
}  // namespace tempo
