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

// What the forward and the backward share: rows of the [batch, heads, seq_q, cols] scores,
// the scale, the causal mask and the dropout. A block of query rows: these `rows` are rows
// row_offset .. row_offset + rows - 1 of seq_q (seq_q = 0: seq_q = rows, row_offset = 0).
// Causal masking, the mask rows and the dropout element indices use the absolute row, so
// blocks reproduce the whole-matrix result (and draw their bits: philox mode).
struct AttentionSoftmaxParams {
  DType dtype = DType::kFloat32;
  int64_t batch = 0, heads = 0, rows = 0, cols = 0;
  int64_t row_offset = 0, seq_q = 0;
  double scale = 1.0;
  bool causal = false;  // mask j > i (top-left aligned, as torch's is_causal)
  double p = 0.0;       // dropout probability
  DropoutMode mode = DropoutMode::kBits;
  PhiloxState rng;  // keep bit of element ((b A + h) seq_q + i) cols + j

  TEMPO_HD int64_t rows_total() const { return batch * heads * rows; }
  TEMPO_HD int64_t seq() const { return seq_q > 0 ? seq_q : rows; }
  TEMPO_HD bool block() const { return row_offset != 0 || (seq_q != 0 && seq_q != rows); }
};

struct AttentionSoftmaxForwardParams : AttentionSoftmaxParams {
  void* scores = nullptr;                 // in: q k^T, rows_total x cols, contiguous; out: P
  void* dropped = nullptr;                // out when p > 0: P * keep / (1 - p)
  uint8_t* mask_bits = nullptr;           // out when p > 0 in bits mode: bit_mask_bytes(rows_total * cols)
  const float* attn_mask = nullptr;       // optional additive fp32 mask
  int64_t mask_stride[4] = {0, 0, 0, 0};  // element (b, h, i, j) at b s0 + h s1 + i s2 + j s3
};

struct AttentionSoftmaxBackwardParams : AttentionSoftmaxParams {
  void* grad = nullptr;                // in: dL/dP_d (dL/dP without dropout); out: dL/d(q k^T)
  const void* probs = nullptr;         // P
  const uint8_t* mask_bits = nullptr;  // bits mode: the forward's bits; philox mode: null
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
