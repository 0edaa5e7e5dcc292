// Internal to the torch layer: argument checks and the mask conversion shared by the
// attention family (attention.cpp, fused_attention.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

#include <cmath>
#include <limits>
#include <optional>

#include "common.h"
#include "dtype.h"
#include "tempo/attention.h"
#include "tempo/memory.h"

namespace tempo::torch_impl {

inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* op) {
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    check_floating(*t, op, name);
    check_device(*t, op, name);
    TORCH_CHECK(t->dim() == 4, op, ": argument '", name, "' must be 4-D [batch, heads, seq, head_dim], got shape ",
                t->sym_sizes());
  }
  check_like(k, q, op, "k");
  check_like(v, q, op, "v");
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0) && v.sym_size(0) == q.sym_size(0), op,
              ": q, k and v must have one batch size, got ", q.sym_size(0), ", ", k.sym_size(0), ", ", v.sym_size(0));
  TORCH_CHECK(k.sym_size(1) == q.sym_size(1) && v.sym_size(1) == q.sym_size(1), op,
              ": q, k and v must have one number of heads, got ", q.sym_size(1), ", ", k.sym_size(1), ", ",
              v.sym_size(1));
  TORCH_CHECK(k.sym_size(3) == q.sym_size(3), op, ": argument 'k' must have the head dim of q (", q.sym_size(3),
              "), got ", k.sym_size(3));
  TORCH_CHECK(v.sym_size(2) == k.sym_size(2), op, ": argument 'v' must have the sequence length of k (", k.sym_size(2),
              "), got ", v.sym_size(2));
}

inline double scale_of(const at::Tensor& q, std::optional<double> scale) {
  if (scale.has_value()) return *scale;
  const int64_t d = q.sym_size(3).guard_int(__FILE__, __LINE__);
  return 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(d, 1)));
}

// The mask as additive fp32 values (bool: 0 where true, -inf where false), still in its own
// (broadcastable) shape, expanded to [B, A, Sq, Sk] by strides.
inline at::Tensor additive_mask(const at::Tensor& mask, c10::SymIntArrayRef sizes, const c10::Device& device,
                                const char* op) {
  TORCH_CHECK(mask.scalar_type() == at::kBool || at::isFloatingType(mask.scalar_type()), op,
              ": argument 'attn_mask' must be bool or floating, got ", mask.scalar_type());
  TORCH_CHECK(mask.device() == device, op, ": argument 'attn_mask' must be on the device of q (", device, "), got ",
              mask.device());
  TORCH_CHECK(!mask.requires_grad(), op,
              ": argument 'attn_mask' requires grad; gradients of the mask are not "
              "supported (pass a mask without requires_grad, or use backend='eager')");
  TORCH_CHECK(mask.dim() <= 4 && at::is_expandable_to(mask.sym_sizes(), sizes), op, ": argument 'attn_mask' of shape ",
              mask.sym_sizes(), " does not broadcast to [batch, heads, q_len, k_len] = ", sizes);
  at::Tensor add =
      mask.scalar_type() == at::kBool
          ? at::where(mask, at::zeros({}, mask.options().dtype(at::kFloat)),
                      at::full({}, -std::numeric_limits<float>::infinity(), mask.options().dtype(at::kFloat)))
          : mask.to(at::kFloat);
  return add.expand_symint(sizes);
}

// The core's softmax forward over `scores` ([B, A, rows, cols], rows starting at row_offset
// of q's seq_q): P written over it and, with dropout, P_d into `dropped`. The whole matrix
// (row_offset 0, rows = seq_q) may store its bits (bits mode); blocks draw them (philox).
inline void softmax_forward(const at::Tensor& scores, const at::Tensor& dropped, const at::Tensor& mask,
                            const at::Tensor& q, int64_t row_offset, double scale, bool causal, double p,
                            DropoutMode mode, uint8_t* mask_bits, const PhiloxState& rng, const char* op) {
  if (q.is_meta() || scores.numel() == 0) return;
  AttentionSoftmaxForwardParams params;
  params.dtype = to_core_dtype(q.scalar_type());
  params.scores = scores.mutable_data_ptr();
  params.dropped = dropped.defined() ? dropped.mutable_data_ptr() : nullptr;
  params.mode = mode;
  params.mask_bits = mask_bits;
  if (mask.defined()) {
    params.attn_mask = mask.const_data_ptr<float>();
    for (int d = 0; d < 4; ++d) params.mask_stride[d] = mask.stride(d);
  }
  params.batch = scores.size(0);
  params.heads = scores.size(1);
  params.rows = scores.size(2);
  params.cols = scores.size(3);
  params.row_offset = row_offset;
  params.seq_q = q.size(2);
  params.scale = scale;
  params.causal = causal;
  params.p = p;
  params.rng = rng;
  run_core(q, params, attention_softmax_forward_cpu, attention_softmax_forward_cuda, op);
  // Data movement (tempo::memory::TrafficScope): S read, P written over it, P_d beside it.
  const int64_t bytes = scores.numel() * static_cast<int64_t>(scores.element_size());
  memory::note_traffic("tempo core: attention softmax (+ dropout)", bytes, dropped.defined() ? 2 * bytes : bytes);
}

// Data movement of the core's softmax backward over dS ([.., rows, cols], in place) with P.
inline void note_softmax_backward_traffic(const at::Tensor& ds) {
  const int64_t bytes = ds.numel() * static_cast<int64_t>(ds.element_size());
  memory::note_traffic("tempo core: attention softmax backward", 2 * bytes, bytes);
}

}  // namespace tempo::torch_impl
