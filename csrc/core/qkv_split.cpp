// Backend-independent parts of the q/k/v split: parameter validation, the CUDA bias gradient's
// workspace size.
#include "tempo/qkv_split.h"

#include <algorithm>
#include <string>

namespace tempo::detail {

namespace {
Status check_sizes(const QkvSplitParams& p, const char* what) {
  TEMPO_CORE_CHECK(p.dtype == DType::kFloat32 || p.dtype == DType::kFloat64 || p.dtype == DType::kBFloat16 ||
                       p.dtype == DType::kFloat16,
                   std::string(what) + ": unsupported dtype");
  TEMPO_CORE_CHECK(p.batch >= 0 && p.seq >= 0 && p.heads >= 0 && p.head_dim >= 0,
                   std::string(what) + ": sizes must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({p.batch, p.seq, 3, p.heads, p.head_dim}), std::string(what) + ": the size is too large");
  return Status::Ok();
}
}  // namespace

Status validate(const QkvSplitForwardParams& p) {
  Status s = check_sizes(p, "qkv split forward");
  if (!s.ok() || p.numel() == 0) return s;
  TEMPO_CORE_CHECK(p.z && p.q && p.k && p.v, "qkv split forward: z, q, k and v must be non-null");
  return Status::Ok();
}

Status validate(const QkvSplitBackwardParams& p) {
  Status s = check_sizes(p, "qkv split backward");
  if (!s.ok() || p.numel() == 0) return s;
  TEMPO_CORE_CHECK(p.grad_q && p.grad_k && p.grad_v && p.grad_z,
                   "qkv split backward: grad_q, grad_k, grad_v and grad_z must be non-null");
  return Status::Ok();
}

}  // namespace tempo::detail

namespace tempo {
int64_t qkv_split_workspace_elems(int64_t tokens, int64_t cols) {
  return std::min<int64_t>(std::max<int64_t>(tokens, 1), kQkvSplitBiasGroups) * cols;
}
TEMPO_CUDA_UNAVAILABLE(qkv_split_forward_cuda, QkvSplitForwardParams, "qkv split forward")
TEMPO_CUDA_UNAVAILABLE(qkv_split_backward_cuda, QkvSplitBackwardParams, "qkv split backward")
}  // namespace tempo
