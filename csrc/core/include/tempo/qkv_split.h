// The q/k/v split of a fused q/k/v projection (the Data Movement paper's attention input bias).
#pragma once

#include "tempo/common.h"

namespace tempo {

// The attention input bias (Ivanov et al.'s "aib"): the one q/k/v projection z = x W^T
// ([batch, seq, 3, heads, head_dim], contiguous, no bias yet) plus its bias ([3 heads head_dim],
// optional), written once as q, k and v, each [batch, heads, seq, head_dim] contiguous: the
// layout the attention matmuls read. The backward is the reverse gather, dz from dq, dk and
// dv, with the bias gradient (dz's column sums) in the same pass.
struct QkvSplitParams {
  DType dtype = DType::kFloat32;
  int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
  TEMPO_HD int64_t cols() const { return 3 * heads * head_dim; }
  TEMPO_HD int64_t numel() const { return batch * seq * cols(); }
};

struct QkvSplitForwardParams : QkvSplitParams {
  const void* z = nullptr;
  const void* bias = nullptr;  // optional
  void* q = nullptr;           // out
  void* k = nullptr;           // out
  void* v = nullptr;           // out
};

struct QkvSplitBackwardParams : QkvSplitParams {
  const void* grad_q = nullptr;
  const void* grad_k = nullptr;
  const void* grad_v = nullptr;
  void* grad_z = nullptr;     // out
  void* grad_bias = nullptr;  // out, optional: cols(), accumulated in double (CPU) / the math type (CUDA)
  // Scratch of the CUDA bias gradient: qkv_split_workspace_elems(batch seq, cols) elements of
  // the math type (fp32, fp64 for fp64 data).
  void* workspace = nullptr;
};

constexpr int64_t kQkvSplitBiasGroups = 256;
int64_t qkv_split_workspace_elems(int64_t tokens, int64_t cols);

Status qkv_split_forward_cpu(const QkvSplitForwardParams& p);
Status qkv_split_backward_cpu(const QkvSplitBackwardParams& p);
Status qkv_split_forward_cuda(const QkvSplitForwardParams& p, void* stream);
Status qkv_split_backward_cuda(const QkvSplitBackwardParams& p, void* stream);

namespace detail {
Status validate(const QkvSplitForwardParams& p);
Status validate(const QkvSplitBackwardParams& p);
}  // namespace detail

}  // namespace tempo
