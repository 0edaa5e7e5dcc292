// Schemas, kernels and C++ API of tempo::dropout. The kernels are device-generic
// (CompositeExplicitAutograd) like the activations'; the Philox state is drawn inside the
// forward kernel, below autograd, so a compiled graph draws a fresh one on every call.
#include "tempo/ops/dropout.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common.h"
#include "dtype.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def("dropout(Tensor x, float p, str mode='bits') -> Tensor", {at::Tag::nondeterministic_seeded});
  m.def("dropout_forward(Tensor x, float p, str mode) -> (Tensor, Tensor)", {at::Tag::nondeterministic_seeded});
  m.def("dropout_backward(Tensor grad, Tensor keep, float p, str mode) -> Tensor");
}

namespace tempo {
namespace {
using namespace torch_impl;

std::tuple<at::Tensor, at::Tensor> dropout_forward_kernel(const at::Tensor& x, double p, c10::string_view mode_name) {
  const char* op = "tempo::dropout";
  check_floating(x, op, "x");
  check_device(x, op, "x");
  check_probability(p, op, "p");
  const DropoutMode mode = dropout_mode(mode_name, op);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  DropoutKeep k = new_dropout_keep(x, p, mode);
  if (x.is_meta() || x.numel() == 0) return {y, k.keep};
  c10::OptionalDeviceGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  DropoutForwardParams params;
  params.dtype = to_core_dtype(x.scalar_type());
  params.x = xc.const_data_ptr();
  params.y = y.mutable_data_ptr();
  params.mode = mode;
  params.mask = k.mask;
  params.p = p;
  params.rng = k.rng;
  params.numel = x.numel();
  run_core(x, params, dropout_forward_cpu, dropout_forward_cuda, op);
  return {y, k.keep};
}

at::Tensor dropout_backward_kernel(const at::Tensor& grad, const at::Tensor& keep, double p,
                                   c10::string_view mode_name) {
  const char* op = "tempo::dropout_backward";
  check_floating(grad, op, "grad");
  check_device(grad, op, "grad");
  check_probability(p, op, "p");
  const DropoutMode mode = dropout_mode(mode_name, op);
  DropoutBackwardParams params;
  params.mode = mode;
  read_dropout_keep(keep, grad, p, mode, op, &params.mask, &params.rng);
  at::Tensor dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  if (grad.is_meta() || grad.numel() == 0) return dx;
  c10::OptionalDeviceGuard guard(grad.device());
  const at::Tensor gc = grad.contiguous();
  params.dtype = to_core_dtype(grad.scalar_type());
  params.grad_y = gc.const_data_ptr();
  params.grad_x = dx.mutable_data_ptr();
  params.p = p;
  params.numel = grad.numel();
  run_core(grad, params, dropout_backward_cpu, dropout_backward_cuda, op);
  return dx;
}

at::Tensor dropout_kernel(const at::Tensor& x, double p, c10::string_view mode) {
  return std::get<0>(dropout_forward_kernel(x, p, mode));
}

}  // namespace

at::Tensor dropout(const at::Tensor& x, double p, bool train, c10::string_view mode) {
  check_probability(p, "tempo::dropout", "p");
  dropout_mode(mode, "tempo::dropout");
  if (!train || p == 0.0) return x;
  static auto op = op_handle<at::Tensor(const at::Tensor&, double, c10::string_view)>("tempo::dropout");
  return op.call(x, p, mode);
}

std::tuple<at::Tensor, at::Tensor> dropout_forward(const at::Tensor& x, double p, c10::string_view mode) {
  static const auto& op = op_for<&dropout_forward>("tempo::dropout_forward");
  return op.call(x, p, mode);
}

at::Tensor dropout_backward(const at::Tensor& grad, const at::Tensor& keep, double p, c10::string_view mode) {
  static const auto& op = op_for<&dropout_backward>("tempo::dropout_backward");
  return op.call(grad, keep, p, mode);
}

}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("dropout", tempo::dropout_kernel);
  m.impl("dropout_forward", tempo::dropout_forward_kernel);
  m.impl("dropout_backward", tempo::dropout_backward_kernel);
}
