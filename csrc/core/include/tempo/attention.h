// The fused softmax parts of attention (Tempo's output-only softmax and sub-layer dropout
// recomputation). The matmuls around them run in the framework (BLAS / cuBLAS):
//   forward:  S = q k^T (in `scores`), then one pass per row: x = scale S + mask (additive,
//             broadcast by strides) with the causal mask, P = softmax(x) written over S, and
//             with dropout the dropped probabilities P * keep / (1 - p) into `dropped` (a
//             temporary for P_d v) and the keep bits. Nothing before the softmax is kept.
//   backward: given dL/dP_d = dO v^T in `grad`, one pass per row, in place:
//             dP = dL/dP_d * keep / (1 - p), dL/dS = scale P (dP - sum_j dP P).
// The dropped probabilities for dv are recomputed from P and the bits by the dropout
// backward kernel (dropout.h). Rows whose every logit is masked give P = 0.
#pragma once

#include "tempo/common.h"
#include "tempo/dropout.h"

namespace tempo {

struct AttentionSoftmaxForwardParams {
  DType dtype = DType::kFloat32;
  void* scores = nullptr;           // in: q k^T, rows_total x cols, contiguous; out: P
  void* dropped = nullptr;          // out when p > 0: P * keep / (1 - p)
  DropoutMode mode = DropoutMode::kBits;
  uint8_t* mask_bits = nullptr;     // out when p > 0 in bits mode: bit_mask_bytes(rows_total * cols);
                                    // philox mode (and always for a block of rows): null
  const float* attn_mask = nullptr; // optional additive fp32 mask
  int64_t mask_stride[4] = {0, 0, 0, 0};  // element (b, h, i, j) at b s0 + h s1 + i s2 + j s3
  int64_t batch = 0, heads = 0, rows = 0, cols = 0;  // rows_total = batch * heads * rows
  // A block of query rows: these `rows` are rows row_offset .. row_offset + rows - 1 of
  // seq_q (0: seq_q = rows, row_offset = 0). Causal masking, the mask rows and the dropout
  // element indices use the absolute row, so blocks reproduce the whole-matrix result.
  int64_t row_offset = 0, seq_q = 0;
  double scale = 1.0;
  bool causal = false;              // mask j > i (top-left aligned, as torch's is_causal)
  double p = 0.0;
  PhiloxState rng;                  // keep bit of element ((b A + h) seq_q + i) cols + j
};

struct AttentionSoftmaxBackwardParams {
  DType dtype = DType::kFloat32;
  void* grad = nullptr;              // in: dL/dP_d (dL/dP without dropout); out: dL/d(q k^T)
  const void* probs = nullptr;       // P
  DropoutMode mode = DropoutMode::kBits;
  const uint8_t* mask_bits = nullptr;  // bits mode: the forward's bits; philox mode: null (drawn from rng)
  int64_t rows_total = 0, cols = 0;
  // A block of query rows, as in the forward: rows_total = batch_heads * rows.
  int64_t rows = 0, row_offset = 0, seq_q = 0;  // rows = 0: the whole matrix
  double scale = 1.0;
  double p = 0.0;
  PhiloxState rng;
};

Status attention_softmax_forward_cpu(const AttentionSoftmaxForwardParams& p);
Status attention_softmax_backward_cpu(const AttentionSoftmaxBackwardParams& p);
Status attention_softmax_forward_cuda(const AttentionSoftmaxForwardParams& p, void* stream);
Status attention_softmax_backward_cuda(const AttentionSoftmaxBackwardParams& p, void* stream);

namespace detail {
Status validate(const AttentionSoftmaxForwardParams& p);
Status validate(const AttentionSoftmaxBackwardParams& p);
}  // namespace detail

}  // namespace tempo
