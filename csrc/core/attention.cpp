// Backend-independent parts of the attention softmax: parameter validation.
#include "tempo/attention.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace tempo::detail {

namespace {
bool known(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kBFloat16 || d == DType::kFloat16;
}
}  // namespace

namespace {
// What the forward and the backward check alike; `w` names the caller.
Status check_softmax(const AttentionSoftmaxParams& p, const std::string& w) {
  TEMPO_CORE_CHECK(known(p.dtype), w + ": unsupported dtype");
  TEMPO_CORE_CHECK(p.batch >= 0 && p.heads >= 0 && p.rows >= 0 && p.cols >= 0, w + ": sizes must be non-negative");
  TEMPO_CORE_CHECK(p.row_offset >= 0 && p.seq_q >= 0, w + ": row_offset and seq_q must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({p.batch, p.heads, p.rows, p.cols}) && numel_fits({p.batch, p.heads, p.seq_q, p.cols}),
                   w + ": the scores' size is too large");
  TEMPO_CORE_CHECK(p.seq_q == 0 ? p.row_offset == 0 : p.rows <= p.seq_q - p.row_offset,
                   w + ": the block of rows [row_offset, row_offset + rows) must lie within seq_q");
  TEMPO_CORE_CHECK(std::isfinite(p.scale), w + ": scale must be finite");
  TEMPO_CORE_CHECK(p.p >= 0.0 && p.p <= 1.0, w + ": p must be in [0, 1]");
  // A block of rows indexes its elements by the whole matrix: packed bits of the block
  // alone would be misread; blocks draw their bits (philox).
  if (p.rows_total() * p.cols > 0 && p.block())
    TEMPO_CORE_CHECK(p.mode == DropoutMode::kPhilox, w + ": a block of rows needs philox mode");
  return Status::Ok();
}
}  // namespace

Status validate(const AttentionSoftmaxForwardParams& p) {
  const std::string w = "attention softmax forward";
  Status s = check_softmax(p, w);
  if (!s.ok() || p.rows_total() * p.cols == 0) return s;
  TEMPO_CORE_CHECK(p.scores, w + ": scores must be non-null");
  if (p.p > 0.0) TEMPO_CORE_CHECK(p.dropped, w + ": dropout needs the dropped output");
  return check_dropout_mask(p.mode, p.p, p.mask_bits, "attention softmax forward");
}

Status validate(const AttentionSoftmaxBackwardParams& p) {
  const std::string w = "attention softmax backward";
  Status s = check_softmax(p, w);
  if (!s.ok() || p.rows_total() * p.cols == 0) return s;
  TEMPO_CORE_CHECK(p.grad && p.probs, w + ": grad and probs must be non-null");
  return check_dropout_mask(p.mode, p.p, p.mask_bits, "attention softmax backward");
}

}  // namespace tempo::detail

namespace tempo {
TEMPO_CUDA_UNAVAILABLE(attention_softmax_forward_cuda, AttentionSoftmaxForwardParams, "attention softmax forward")
TEMPO_CUDA_UNAVAILABLE(attention_softmax_backward_cuda, AttentionSoftmaxBackwardParams, "attention softmax backward")
}  // namespace tempo
