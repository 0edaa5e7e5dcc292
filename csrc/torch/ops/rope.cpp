// Schemas, kernels and C++ API of tempo::rope (the core's rope kernels). A plain kernel to the
// traffic account: its operands and results are what it moves.
#include "tempo/ops/rope.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common.h"
#include "dtype.h"
#include "tempo/rope.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_backward(Tensor grad, Tensor cos, Tensor sin) -> Tensor");
}

namespace tempo {
namespace {
using namespace torch_impl;

// Checks x (named `arg`) and the tables; returns the tables' batch (1 or x's).
int64_t check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const char* op, const char* arg) {
  check_floating(x, op, arg);
  check_device(x, op, arg);
  TORCH_CHECK(x.dim() == 4, op, ": argument '", arg, "' must be [batch, heads, seq, head_dim], got ", x.sym_sizes());
  for (const auto* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    TORCH_CHECK(t->scalar_type() == x.scalar_type() ||
                    (t->scalar_type() == at::kFloat && at::elementSize(x.scalar_type()) == 2),
                op, ": argument '", name, "' must have the dtype of ", arg, " (", x.scalar_type(),
                ") or float32 for 16-bit ", arg, ", got ", t->scalar_type());
    TORCH_CHECK(t->device() == x.device(), op, ": argument '", name, "' must be on the device of ", arg, " (",
                x.device(), "), got ", t->device());
  }
  TORCH_CHECK(cos.sym_sizes() == sin.sym_sizes(), op, ": arguments 'cos' and 'sin' must have one shape, got ",
              cos.sym_sizes(), " and ", sin.sym_sizes());
  const int64_t d = cos.dim();
  const bool shape_ok = d >= 2 && d <= 4 && cos.sym_size(-2) == x.sym_size(2) && cos.sym_size(-1) <= x.sym_size(3) &&
                        cos.sym_size(-1) % 2 == 0 && (d < 4 || cos.sym_size(1) == 1) &&
                        (d < 3 || cos.sym_size(0) == 1 || cos.sym_size(0) == x.sym_size(0));
  TORCH_CHECK(shape_ok, op, ": arguments 'cos' and 'sin' must be [seq, r], [b, seq, r] or [b, 1, seq, r] for '", arg,
              "' of shape ", x.sym_sizes(), " (seq = ", x.sym_size(2), ", b 1 or ", x.sym_size(0),
              ", r even, at most head_dim = ", x.sym_size(3), "), got ", cos.sym_sizes());
  return d >= 3 && cos.size(0) != 1 ? x.size(0) : 1;
}

at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  const char* op = backward ? "tempo::rope_backward" : "tempo::rope";
  const int64_t table_batch = check_rope(x, cos, sin, op, backward ? "grad" : "x");
  // x's layout, as torch's elementwise ops keep it (a transposed q stays one for the attention
  // that reads it), where its last dimension is the innermost; else contiguous
  at::Tensor out = at::empty_like(x);
  if (out.sym_stride(3) != 1 && out.sym_size(3) != 1)
    out = at::empty_symint(x.sym_sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (shapes_only(x) || x.numel() == 0) return out;
  c10::OptionalDeviceGuard guard(x.device());
  const at::Tensor xs = x.stride(3) == 1 ? x : x.contiguous();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  if (x.is_meta()) return out;  // tempo.plan's count: the copies above, then the output
  RopeParams p;
  p.dtype = to_core_dtype(x.scalar_type());
  p.table_dtype = to_core_dtype(cos.scalar_type());
  p.batch = x.size(0);
  p.heads = x.size(1);
  p.seq = x.size(2);
  p.head_dim = x.size(3);
  p.rotary_dim = cos.size(-1);
  p.table_batch = table_batch;
  p.x_stride_batch = xs.stride(0);
  p.x_stride_head = xs.stride(1);
  p.x_stride_seq = xs.stride(2);
  p.out_stride_batch = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.out_stride_seq = out.stride(2);
  p.x = xs.const_data_ptr();
  p.cos = c.const_data_ptr();
  p.sin = s.const_data_ptr();
  p.out = out.mutable_data_ptr();
  if (backward)
    run_core(x, p, rope_backward_cpu, rope_backward_cuda, op);
  else
    run_core(x, p, rope_forward_cpu, rope_forward_cuda, op);
  return out;
}

at::Tensor rope_kernel(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return run(x, cos, sin, false);
}
at::Tensor rope_backward_kernel(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin) {
  return run(grad, cos, sin, true);
}

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  static const auto& op = op_for<&rope>("tempo::rope");
  return op.call(x, cos, sin);
}

at::Tensor rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin) {
  static const auto& op = op_for<&rope_backward>("tempo::rope_backward");
  return op.call(grad, cos, sin);
}

}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("rope", tempo::rope_kernel);
  m.impl("rope_backward", tempo::rope_backward_kernel);
}
