// Autocast kernels of tempo's ops, so that they run under torch.autocast (CPU and CUDA) as
// torch's own counterparts do. The norms (layer_norm, rms_norm, bias_dropout_add_layer_norm):
// on CUDA in float32, as autocast runs torch's layer_norm there; on CPU in x's dtype, as
// torch's CPU layer_norm returns a bf16 x's norm in bf16 (tempo casts the parameters to it,
// so that the saved output stays 2 bytes; the error this adds is in docs/accuracy.md).
// Attention in the autocast dtype, as scaled_dot_product_attention; the activations' x and
// bias promoted to the wider of the two. linear_cross_entropy in float32: autocast's
// cross_entropy returns an fp32 loss, which the op (returning hidden's dtype) gives only from
// fp32 inputs; its logits are then fp32 too, never kept, at the cost of an fp32 head GEMM;
// qkv_split's bias cast to z's dtype, as linear's bias is. Each kernel casts the floating
// tensor arguments and calls the op again with autocast off.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace tempo {
namespace {

enum class Cast { kFloat32, kLikeX, kLowerPrecision, kPromote };

template <Cast policy, c10::DeviceType device>
void autocast_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const size_t begin = stack->size() - n;
  c10::ScalarType target = at::kFloat;
  if (policy == Cast::kLowerPrecision) {
    target = at::autocast::get_autocast_dtype(device);
  } else if (policy == Cast::kLikeX) {
    target = (*stack)[begin].toTensor().scalar_type();
  } else if (policy == Cast::kPromote) {
    bool first = true;
    for (size_t i = begin; i < stack->size(); ++i)
      if (const auto& a = (*stack)[i]; a.isTensor() && a.toTensor().defined() && a.toTensor().is_floating_point()) {
        target = first ? a.toTensor().scalar_type() : at::promote_types(target, a.toTensor().scalar_type());
        first = false;
      }
  }
  for (size_t i = begin; i < stack->size(); ++i)
    if (auto& a = (*stack)[i]; a.isTensor()) {
      const at::Tensor& t = a.toTensor();
      if (t.defined() && t.is_floating_point() && t.scalar_type() != target) a = t.to(target);
    }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  op.callBoxed(stack);
}

template <c10::DeviceType device>
void register_autocast(torch::Library& m) {
  constexpr Cast norms = device == c10::DeviceType::CUDA ? Cast::kFloat32 : Cast::kLikeX;
  for (const char* name : {"layer_norm", "rms_norm", "bias_dropout_add_layer_norm"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<norms, device>>());
  for (const char* name : {"attention", "fused_attention"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<Cast::kLowerPrecision, device>>());
  for (const char* name : {"gelu", "silu"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<Cast::kPromote, device>>());
  m.impl("linear_cross_entropy", torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<Cast::kFloat32, device>>());
  m.impl("qkv_split", torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<Cast::kLikeX, device>>());
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, AutocastCPU, m) { tempo::register_autocast<c10::DeviceType::CPU>(m); }
TORCH_LIBRARY_IMPL(tempo, AutocastCUDA, m) { tempo::register_autocast<c10::DeviceType::CUDA>(m); }
