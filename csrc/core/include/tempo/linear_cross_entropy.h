// The row passes of linear_cross_entropy (a language model's loss from its hidden states,
// without keeping the logits). The framework forms each chunk of logits z = h W^T (+ b) with its
// GEMM; these kernels take one pass over each row of the chunk, in the math type (float64 for
// float64 data, float32 otherwise), reading 16-bit logits as they are (no float32 copy):
//   forward:  lse_r = log sum_j e^(z_rj)  (shifted by the row's maximum), and the row's loss
//             l_r = -(1 - eps) (z_r,y_r - lse_r) - eps (mean_j z_rj - lse_r); 0 where y_r is ignored;
//             the mean term only where eps > 0 (a -inf logit, a masked token, leaves l_r finite)
//   backward: in place, z_rj <- s_r (e^(z_rj - lse_r) - (1 - eps) [j = y_r] - eps / V), the
//             gradient of the logits (s_r: the row's gradient weight, 0 where ignored), which the
//             framework's GEMMs turn into those of the hidden states, the weight and the bias.
// eps is the label smoothing. A label outside [0, V) that is not ignore_index is the framework's
// to refuse (its check runs on the device, later); the kernels clamp it, so nothing is read out
// of bounds.
#pragma once

#include "tempo/common.h"

namespace tempo {

struct LinearCrossEntropyParams {
  DType dtype = DType::kFloat32;    // the logits'; lse, loss and scale are in its math type
  int64_t rows = 0, vocab = 0;      // the chunk: rows x vocab logits, contiguous
  const int64_t* labels = nullptr;  // rows
  int64_t ignore_index = -100;
  double smoothing = 0.0;  // in [0, 1]
};

struct LinearCrossEntropyForwardParams : LinearCrossEntropyParams {
  const void* logits = nullptr;
  void* lse = nullptr;   // out: rows
  void* loss = nullptr;  // out: rows (0 where ignored)
};

struct LinearCrossEntropyBackwardParams : LinearCrossEntropyParams {
  void* logits = nullptr;       // in: z; out: the gradient of the logits, in place
  const void* lse = nullptr;    // rows: the forward's
  const void* scale = nullptr;  // rows: each row's gradient weight
};

// The column a row's label reads: the label clamped into [0, vocab) (an ignored row's is never
// used for its loss, and its gradient weight is 0). The same rule in every kernel.
TEMPO_HD int64_t linear_cross_entropy_label_column(int64_t label, int64_t vocab) {
  return label < 0 ? 0 : label >= vocab ? vocab - 1 : label;
}

Status linear_cross_entropy_forward_cpu(const LinearCrossEntropyForwardParams& p);
Status linear_cross_entropy_backward_cpu(const LinearCrossEntropyBackwardParams& p);
Status linear_cross_entropy_forward_cuda(const LinearCrossEntropyForwardParams& p, void* stream);
Status linear_cross_entropy_backward_cuda(const LinearCrossEntropyBackwardParams& p, void* stream);

namespace detail {
Status validate(const LinearCrossEntropyForwardParams& p);
Status validate(const LinearCrossEntropyBackwardParams& p);
}  // namespace detail

}  // namespace tempo
