// Schemas, kernels and C++ API of tempo::qkv_split (the attention input bias; the core's
// qkv_split kernels in the attention family). A plain kernel to the traffic account: its
// operands and results are what it moves.
#include "tempo/ops/qkv_split.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common.h"
#include "dtype.h"
#include "tempo/qkv_split.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def("qkv_split(Tensor z, Tensor? bias, int heads) -> (Tensor, Tensor, Tensor)");
  m.def("qkv_split_backward(Tensor grad_q, Tensor grad_k, Tensor grad_v, bool bias_grad=False) -> (Tensor, Tensor)");
}

namespace tempo {
namespace {
using namespace torch_impl;

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_split_kernel(const at::Tensor& z,
                                                                const std::optional<at::Tensor>& bias, int64_t heads) {
  const char* op = "tempo::qkv_split";
  check_floating(z, op, "z");
  check_device(z, op, "z");
  TORCH_CHECK(z.dim() == 3, op, ": argument 'z' must be [batch, seq, 3 hidden], got ", z.sym_sizes());
  TORCH_CHECK(heads > 0, op, ": argument 'heads' must be positive, got ", heads);
  TORCH_CHECK(z.sym_size(2) % (3 * heads) == 0, op,
              ": argument 'z' must have a last dimension divisible by 3 heads = ", 3 * heads, ", got ", z.sym_size(2));
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_like(*bias, z, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == z.sym_size(2), op, ": argument 'bias' must have shape [",
                z.sym_size(2), "] (the last dimension of z), got ", bias->sym_sizes());
  }
  const c10::SymInt B = z.sym_size(0), S = z.sym_size(1), D = z.sym_size(2) / (3 * heads);
  const auto opts = z.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor q = at::empty_symint({B, heads, S, D}, opts);
  at::Tensor k = at::empty_symint({B, heads, S, D}, opts);
  at::Tensor v = at::empty_symint({B, heads, S, D}, opts);
  if (z.is_meta() || z.numel() == 0) return {q, k, v};
  c10::OptionalDeviceGuard guard(z.device());
  const at::Tensor zc = z.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  QkvSplitForwardParams p;
  p.dtype = to_core_dtype(z.scalar_type());
  p.batch = z.size(0);
  p.seq = z.size(1);
  p.heads = heads;
  p.head_dim = z.size(2) / (3 * heads);
  p.z = zc.const_data_ptr();
  p.bias = has_bias ? bc.const_data_ptr() : nullptr;
  p.q = q.mutable_data_ptr();
  p.k = k.mutable_data_ptr();
  p.v = v.mutable_data_ptr();
  run_core(z, p, qkv_split_forward_cpu, qkv_split_forward_cuda, op);
  return {q, k, v};
}

std::tuple<at::Tensor, at::Tensor> qkv_split_backward_kernel(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                             const at::Tensor& grad_v, bool bias_grad) {
  const char* op = "tempo::qkv_split_backward";
  check_floating(grad_q, op, "grad_q");
  check_device(grad_q, op, "grad_q");
  check_like(grad_k, grad_q, op, "grad_k");
  check_like(grad_v, grad_q, op, "grad_v");
  TORCH_CHECK(grad_q.dim() == 4 && grad_k.sym_sizes() == grad_q.sym_sizes() && grad_v.sym_sizes() == grad_q.sym_sizes(),
              op,
              ": arguments 'grad_q', 'grad_k' and 'grad_v' must be [batch, heads, seq, head_dim] of one shape, got ",
              grad_q.sym_sizes(), ", ", grad_k.sym_sizes(), ", ", grad_v.sym_sizes());
  const c10::SymInt B = grad_q.sym_size(0), A = grad_q.sym_size(1), S = grad_q.sym_size(2), D = grad_q.sym_size(3);
  const c10::SymInt cols = 3 * A * D;
  at::Tensor dz = at::empty_symint({B, S, cols}, grad_q.options());
  at::Tensor db = bias_grad ? (grad_q.sym_numel() == 0 ? at::zeros_symint({cols}, grad_q.options())
                                                       : at::empty_symint({cols}, grad_q.options()))
                            : at::empty({0}, grad_q.options());
  if (shapes_only(grad_q) || grad_q.numel() == 0) return {dz, db};
  c10::OptionalDeviceGuard guard(grad_q.device());
  const at::Tensor gq = grad_q.contiguous(), gk = grad_k.contiguous(), gv = grad_v.contiguous();
  if (grad_q.is_meta()) {  // tempo.plan's count: the copies above and CUDA's workspace, then the outputs
    if (bias_grad && on_cuda(grad_q))
      at::empty({qkv_split_workspace_elems(grad_q.size(0) * grad_q.size(2), cols.expect_int())},
                grad_q.options().dtype(grad_q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
    return {dz, db};
  }
  QkvSplitBackwardParams p;
  p.dtype = to_core_dtype(grad_q.scalar_type());
  p.batch = grad_q.size(0);
  p.heads = grad_q.size(1);
  p.seq = grad_q.size(2);
  p.head_dim = grad_q.size(3);
  p.grad_q = gq.const_data_ptr();
  p.grad_k = gk.const_data_ptr();
  p.grad_v = gv.const_data_ptr();
  p.grad_z = dz.mutable_data_ptr();
  at::Tensor workspace;
  if (bias_grad) {
    p.grad_bias = db.mutable_data_ptr();
    if (grad_q.is_cuda()) {
      workspace = at::empty({qkv_split_workspace_elems(p.batch * p.seq, p.cols())},
                            grad_q.options().dtype(grad_q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
      p.workspace = workspace.mutable_data_ptr();
    }
  }
  run_core(grad_q, p, qkv_split_backward_cpu, qkv_split_backward_cuda, op);
  return {dz, db};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_split(const at::Tensor& z, const std::optional<at::Tensor>& bias,
                                                         int64_t heads) {
  static const auto& op = op_for<&qkv_split>("tempo::qkv_split");
  return op.call(z, bias, heads);
}

std::tuple<at::Tensor, at::Tensor> qkv_split_backward(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                      const at::Tensor& grad_v, bool bias_grad) {
  static const auto& op = op_for<&qkv_split_backward>("tempo::qkv_split_backward");
  return op.call(grad_q, grad_k, grad_v, bias_grad);
}

}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("qkv_split", tempo::qkv_split_kernel);
  m.impl("qkv_split_backward", tempo::qkv_split_backward_kernel);
}
