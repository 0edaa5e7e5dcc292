// Schemas, argument checks, kernels and the C++ API of tempo::gelu and tempo::silu.
// One device-generic kernel per op (registered as CompositeExplicitAutograd) serves CPU,
// CUDA and Meta: it checks the arguments, allocates the outputs and hands the core the
// pointers (and the current CUDA stream); on Meta/fake tensors it only allocates. The
// autograd kernel of gelu/silu lives in ../autograd/activation.cpp.
#include "activation.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common.h"
#include "dtype.h"
#include "tempo/ops/activation.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def("gelu(Tensor x, str approximate='none', Tensor? bias=None) -> Tensor");
  m.def("gelu_forward(Tensor x, str approximate, Tensor? bias) -> (Tensor, Tensor)");
  m.def("gelu_backward(Tensor grad, Tensor y, Tensor mask, str approximate, bool bias_grad=False) -> (Tensor, Tensor)");
  m.def("silu(Tensor x, Tensor? bias=None) -> Tensor");
  m.def("silu_forward(Tensor x, Tensor? bias) -> (Tensor, Tensor)");
  m.def("silu_backward(Tensor grad, Tensor y, Tensor mask, bool bias_grad=False) -> (Tensor, Tensor)");
}

namespace tempo {
namespace torch_impl {

Activation gelu_kind(c10::string_view approximate, const char* op) {
  if (approximate == "none") return Activation::kGeluErf;
  if (approximate == "tanh") return Activation::kGeluTanh;
  TORCH_CHECK(false, op, ": argument 'approximate' must be 'none' or 'tanh', got '", std::string(approximate), "'");
}

std::tuple<at::Tensor, at::Tensor> activation_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                                      Activation act, const char* op) {
  check_floating(x, op, "x");
  check_device(x, op, "x");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    const at::Tensor& b = *bias;
    check_floating(b, op, "bias");
    TORCH_CHECK(x.dim() >= 1, op, ": argument 'bias' needs x with at least one dimension, got a scalar x");
    TORCH_CHECK(b.dim() == 1 && b.size(0) == x.size(-1), op, ": argument 'bias' must have shape [", x.size(-1),
                "] (the last dimension of x), got ", b.sizes());
    TORCH_CHECK(b.scalar_type() == x.scalar_type(), op, ": argument 'bias' must have the dtype of x (", x.scalar_type(),
                "), got ", b.scalar_type());
    TORCH_CHECK(b.device() == x.device(), op, ": argument 'bias' must be on the device of x (", x.device(), "), got ",
                b.device());
  }
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = at::empty_symint({bit_mask_bytes(x.sym_numel())}, x.options().dtype(at::kByte));
  if (x.is_meta() || x.numel() == 0) return {y, mask};

  c10::OptionalDeviceGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  ActivationForwardParams p;
  p.act = act;
  p.dtype = to_core_dtype(x.scalar_type());
  p.x = xc.const_data_ptr();
  p.bias = has_bias ? bc.const_data_ptr() : nullptr;
  p.bias_size = has_bias ? bc.numel() : 0;
  p.y = y.mutable_data_ptr();
  p.mask = mask.mutable_data_ptr<uint8_t>();
  p.numel = x.numel();
  run_core(x, p, activation_forward_cpu, activation_forward_cuda, op);
  return {y, mask};
}

// grad_x, and with bias_grad the bias gradient (grad_x summed over all but the last dim, in
// the same pass: Ivanov et al.'s "bdrb"); without it an empty [0] tensor.
std::tuple<at::Tensor, at::Tensor> activation_backward(const at::Tensor& grad, const at::Tensor& y,
                                                       const at::Tensor& mask, bool bias_grad, Activation act,
                                                       const char* op) {
  check_floating(grad, op, "grad");
  check_floating(y, op, "y");
  check_device(y, op, "y");
  TORCH_CHECK(grad.sym_sizes() == y.sym_sizes(), op, ": argument 'grad' must have the shape of y ", y.sym_sizes(),
              ", got ", grad.sym_sizes());
  TORCH_CHECK(grad.scalar_type() == y.scalar_type(), op, ": argument 'grad' must have the dtype of y (",
              y.scalar_type(), "), got ", grad.scalar_type());
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.dim() == 1, op,
              ": argument 'mask' must be a 1-D uint8 tensor of packed bits, got ", mask.scalar_type(), " of shape ",
              mask.sym_sizes());
  TORCH_CHECK(mask.sym_numel() == bit_mask_bytes(y.sym_numel()), op,
              ": argument 'mask' must hold ceil(numel(y) / 8) = ", bit_mask_bytes(y.sym_numel()), " bytes, got ",
              mask.sym_numel());
  TORCH_CHECK(grad.device() == y.device() && mask.device() == y.device(), op,
              ": arguments 'grad', 'y' and 'mask' must be on one device, got ", grad.device(), ", ", y.device(), ", ",
              mask.device());
  TORCH_CHECK(!bias_grad || y.dim() >= 1, op, ": argument 'bias_grad' needs y with at least one dimension");
  at::Tensor dx = at::empty_like(y, at::MemoryFormat::Contiguous);
  at::Tensor db = bias_grad ? (y.sym_numel() == 0 ? at::zeros_symint({y.sym_size(-1)}, y.options())
                                                  : at::empty_symint({y.sym_size(-1)}, y.options()))
                            : at::empty({0}, y.options());
  if (shapes_only(y) || y.numel() == 0) return {dx, db};

  c10::OptionalDeviceGuard guard(y.device());
  const at::Tensor yc = y.contiguous();
  const at::Tensor gc = grad.contiguous();
  const at::Tensor mc = mask.contiguous();
  if (y.is_meta()) {  // tempo.plan's count: the copies above and CUDA's workspace, then the outputs
    if (bias_grad && on_cuda(y))
      at::empty({activation_backward_workspace_elems(y.numel(), y.size(-1))},
                y.options().dtype(y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
    return {dx, db};
  }
  ActivationBackwardParams p;
  p.act = act;
  p.dtype = to_core_dtype(y.scalar_type());
  p.y = yc.const_data_ptr();
  p.mask = mc.const_data_ptr<uint8_t>();
  p.grad_y = gc.const_data_ptr();
  p.grad_x = dx.mutable_data_ptr();
  p.numel = y.numel();
  at::Tensor workspace;
  if (bias_grad) {
    p.grad_bias = db.mutable_data_ptr();
    p.bias_size = y.size(-1);
    if (y.is_cuda()) {
      workspace = at::empty({activation_backward_workspace_elems(p.numel, p.bias_size)},
                            y.options().dtype(y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
      p.workspace = workspace.mutable_data_ptr();
    }
  }
  run_core(y, p, activation_backward_cpu, activation_backward_cuda, op);
  return {dx, db};
}

}  // namespace torch_impl

namespace {
using torch_impl::activation_backward;
using torch_impl::activation_forward;
using torch_impl::gelu_kind;

std::tuple<at::Tensor, at::Tensor> gelu_forward_kernel(const at::Tensor& x, c10::string_view approximate,
                                                       const std::optional<at::Tensor>& bias) {
  return activation_forward(x, bias, gelu_kind(approximate, "tempo::gelu"), "tempo::gelu");
}
std::tuple<at::Tensor, at::Tensor> gelu_backward_kernel(const at::Tensor& grad, const at::Tensor& y,
                                                        const at::Tensor& mask, c10::string_view approximate,
                                                        bool bias_grad) {
  return activation_backward(grad, y, mask, bias_grad, gelu_kind(approximate, "tempo::gelu_backward"),
                             "tempo::gelu_backward");
}
std::tuple<at::Tensor, at::Tensor> silu_forward_kernel(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  return activation_forward(x, bias, Activation::kSilu, "tempo::silu");
}
std::tuple<at::Tensor, at::Tensor> silu_backward_kernel(const at::Tensor& grad, const at::Tensor& y,
                                                        const at::Tensor& mask, bool bias_grad) {
  return activation_backward(grad, y, mask, bias_grad, Activation::kSilu, "tempo::silu_backward");
}
// Below autograd (no_grad, inference, tracing of the forward alone): the output only.
at::Tensor gelu_kernel(const at::Tensor& x, c10::string_view approximate, const std::optional<at::Tensor>& bias) {
  return std::get<0>(gelu_forward_kernel(x, approximate, bias));
}
at::Tensor silu_kernel(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  return std::get<0>(silu_forward_kernel(x, bias));
}
}  // namespace

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("gelu", gelu_kernel);
  m.impl("gelu_forward", gelu_forward_kernel);
  m.impl("gelu_backward", gelu_backward_kernel);
  m.impl("silu", silu_kernel);
  m.impl("silu_forward", silu_forward_kernel);
  m.impl("silu_backward", silu_backward_kernel);
}

// ---- C++ API: through the dispatcher, so autograd and every backend apply ------------------

using torch_impl::op_for;

at::Tensor gelu(const at::Tensor& x, c10::string_view approximate, const std::optional<at::Tensor>& bias) {
  static const auto& op = op_for<&gelu>("tempo::gelu");
  return op.call(x, approximate, bias);
}

at::Tensor silu(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  static const auto& op = op_for<&silu>("tempo::silu");
  return op.call(x, bias);
}

std::tuple<at::Tensor, at::Tensor> gelu_forward(const at::Tensor& x, c10::string_view approximate,
                                                const std::optional<at::Tensor>& bias) {
  static const auto& op = op_for<&gelu_forward>("tempo::gelu_forward");
  return op.call(x, approximate, bias);
}

std::tuple<at::Tensor, at::Tensor> gelu_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                                                 c10::string_view approximate, bool bias_grad) {
  static const auto& op = op_for<&gelu_backward>("tempo::gelu_backward");
  return op.call(grad, y, mask, approximate, bias_grad);
}

std::tuple<at::Tensor, at::Tensor> silu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  static const auto& op = op_for<&silu_forward>("tempo::silu_forward");
  return op.call(x, bias);
}

std::tuple<at::Tensor, at::Tensor> silu_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                                                 bool bias_grad) {
  static const auto& op = op_for<&silu_backward>("tempo::silu_backward");
  return op.call(grad, y, mask, bias_grad);
}

}  // namespace tempo
