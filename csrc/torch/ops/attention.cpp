// Schemas, kernels and C++ API of tempo::attention. The kernels are device-generic
// (CompositeExplicitAutograd): matmuls through ATen, the fused softmax parts through the core.
#include "tempo/ops/attention.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "attention.h"
#include "common.h"
#include "dtype.h"
#include "tempo/attention.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float dropout_p=0.0, bool causal=False, "
      "float? scale=None, str mode='bits') -> Tensor",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool causal, "
      "float? scale, str mode) -> (Tensor, Tensor, Tensor)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor probs, Tensor keep, float dropout_p, "
      "float? scale, str mode) -> (Tensor, Tensor, Tensor)");
}

namespace tempo {
namespace {
using namespace torch_impl;

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_kernel(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
    double dropout_p, bool causal, std::optional<double> scale, c10::string_view mode_name) {
  const char* op = "tempo::attention";
  check_qkv(q, k, v, op);
  check_probability(dropout_p, op, "dropout_p");
  const DropoutMode mode = dropout_mode(mode_name, op);
  const double sc = scale_of(q, scale);
  c10::OptionalDeviceGuard guard(q.device());
  // Scores in q's dtype (as the eager baseline); the softmax overwrites them with P.
  at::Tensor probs = at::matmul(q, k.transpose(-2, -1)).contiguous();
  at::Tensor mask;
  if (attn_mask.has_value() && attn_mask->defined())
    mask = additive_mask(*attn_mask, probs.sym_sizes(), probs.device(), op);
  DropoutKeep keep = new_dropout_keep(probs, dropout_p, mode);
  at::Tensor dropped = dropout_p > 0.0 ? at::empty_like(probs) : at::Tensor();
  softmax_forward(probs, dropped, mask, q, 0, sc, causal, dropout_p, mode, keep.mask, keep.rng, op);
  at::Tensor out = at::matmul(dropped.defined() ? dropped : probs, v);
  return {out, probs, keep.keep};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_kernel(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& probs,
    const at::Tensor& keep, double dropout_p, std::optional<double> scale, c10::string_view mode_name) {
  const char* op = "tempo::attention_backward";
  check_qkv(q, k, v, op);
  check_probability(dropout_p, op, "dropout_p");
  const DropoutMode mode = dropout_mode(mode_name, op);
  check_like(grad, q, op, "grad");
  check_like(probs, q, op, "probs");
  TORCH_CHECK(probs.dim() == 4 && probs.sym_size(0) == q.sym_size(0) && probs.sym_size(1) == q.sym_size(1) &&
                  probs.sym_size(2) == q.sym_size(2) && probs.sym_size(3) == k.sym_size(2),
              op, ": argument 'probs' must have shape [batch, heads, q_len, k_len], got ", probs.sym_sizes());
  TORCH_CHECK(grad.dim() == 4 && grad.sym_size(0) == q.sym_size(0) && grad.sym_size(1) == q.sym_size(1) &&
                  grad.sym_size(2) == q.sym_size(2) && grad.sym_size(3) == v.sym_size(3),
              op, ": argument 'grad' must have the shape of the output, got ", grad.sym_sizes());
  const double sc = scale_of(q, scale);
  const at::Tensor pc = probs.contiguous();
  AttentionSoftmaxBackwardParams params;
  DropoutBackwardParams drop;
  params.mode = drop.mode = mode;
  read_dropout_keep(keep, pc, dropout_p, mode, op, &params.mask_bits, &params.rng);
  c10::OptionalDeviceGuard guard(q.device());
  const bool real = !q.is_meta() && pc.numel() > 0;
  // dv = P_d^T dO, with P_d recomputed from P and the bits (sub-layer dropout recomputation).
  at::Tensor dv;
  if (dropout_p > 0.0) {
    at::Tensor pd = at::empty_like(pc);
    if (real) {
      drop.dtype = to_core_dtype(q.scalar_type());
      drop.grad_y = pc.const_data_ptr();
      drop.grad_x = pd.mutable_data_ptr();
      drop.mask = params.mask_bits;
      drop.rng = params.rng;
      drop.p = dropout_p;
      drop.numel = pc.numel();
      run_core(q, drop, dropout_backward_cpu, dropout_backward_cuda, op);
      const int64_t bytes = pc.numel() * static_cast<int64_t>(pc.element_size());
      memory::note_traffic("tempo core: attention dropout recomputation", bytes, bytes);
    }
    dv = at::matmul(pd.transpose(-2, -1), grad);
  } else {
    dv = at::matmul(pc.transpose(-2, -1), grad);
  }
  // dS from the output-only softmax backward, in place over dO v^T.
  at::Tensor ds = at::matmul(grad, v.transpose(-2, -1)).contiguous();
  if (real) {
    params.dtype = to_core_dtype(q.scalar_type());
    params.grad = ds.mutable_data_ptr();
    params.probs = pc.const_data_ptr();
    params.batch = pc.size(0);
    params.heads = pc.size(1);
    params.rows = pc.size(2);
    params.cols = pc.size(3);
    params.scale = sc;
    params.p = dropout_p;
    run_core(q, params, attention_softmax_backward_cpu, attention_softmax_backward_cuda, op);
    note_softmax_backward_traffic(ds);
  }
  at::Tensor dq = at::matmul(ds, k);
  at::Tensor dk = at::matmul(ds.transpose(-2, -1), q);
  return {dq, dk, dv};
}

at::Tensor attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                            std::optional<double> scale, c10::string_view mode) {
  return std::get<0>(attention_forward_kernel(q, k, v, attn_mask, dropout_p, causal, scale, mode));
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                     std::optional<double> scale, c10::string_view mode) {
  static const auto& op = op_for<&attention>("tempo::attention");
  return op.call(q, k, v, attn_mask, dropout_p, causal, scale, mode);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v,
                                                                 const std::optional<at::Tensor>& attn_mask,
                                                                 double dropout_p, bool causal,
                                                                 std::optional<double> scale, c10::string_view mode) {
  static const auto& op = op_for<&attention_forward>("tempo::attention_forward");
  return op.call(q, k, v, attn_mask, dropout_p, causal, scale, mode);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& grad, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& probs, const at::Tensor& keep,
                                                                  double dropout_p, std::optional<double> scale,
                                                                  c10::string_view mode) {
  static const auto& op = op_for<&attention_backward>("tempo::attention_backward");
  return op.call(grad, q, k, v, probs, keep, dropout_p, scale, mode);
}

}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("attention", tempo::attention_kernel);
  m.impl("attention_forward", tempo::attention_forward_kernel);
  m.impl("attention_backward", tempo::attention_backward_kernel);
}
