// Backend-independent part of the rotary embedding: parameter validation.
#include "tempo/rope.h"

namespace tempo::detail {

Status validate(const RopeParams& p) {
  const auto floating = [](DType d) {
    return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kBFloat16 || d == DType::kFloat16;
  };
  TEMPO_CORE_CHECK(floating(p.dtype), "rope: unsupported dtype");
  TEMPO_CORE_CHECK(p.table_dtype == p.dtype || (p.table_dtype == DType::kFloat32 && p.dtype != DType::kFloat64),
                   "rope: cos and sin must have x's dtype, or float32 for 16-bit x");
  TEMPO_CORE_CHECK(p.batch >= 0 && p.heads >= 0 && p.seq >= 0 && p.head_dim >= 0, "rope: sizes must be non-negative");
  TEMPO_CORE_CHECK(p.rotary_dim >= 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim,
                   "rope: rotary_dim must be even and at most head_dim");
  TEMPO_CORE_CHECK(p.table_batch == 1 || p.table_batch == p.batch, "rope: the tables' batch must be 1 or x's batch");
  TEMPO_CORE_CHECK(
      numel_fits({p.batch, p.heads, p.seq, p.head_dim}) && numel_fits({p.table_batch, p.seq, p.rotary_dim}),
      "rope: the size is too large");
  if (p.numel() == 0) return Status::Ok();
  TEMPO_CORE_CHECK(p.x_stride_batch >= 0 && p.x_stride_head >= 0 && p.x_stride_seq >= 0 && p.out_stride_batch >= 0 &&
                       p.out_stride_head >= 0 && p.out_stride_seq >= 0,
                   "rope: the strides must be non-negative");
  TEMPO_CORE_CHECK(p.x && p.out && (p.rotary_dim == 0 || (p.cos && p.sin)),
                   "rope: x, cos, sin and out must be non-null");
  return Status::Ok();
}

}  // namespace tempo::detail

namespace tempo {
TEMPO_CUDA_UNAVAILABLE(rope_forward_cuda, RopeParams, "rope forward")
TEMPO_CUDA_UNAVAILABLE(rope_backward_cuda, RopeParams, "rope backward")
}  // namespace tempo
