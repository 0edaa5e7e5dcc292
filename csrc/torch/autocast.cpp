// Autocast kernels of tempo's ops, so that they run under torch.autocast (CPU and CUDA) as
// torch's own counterparts do. The norms (layer_norm, rms_norm, bias_dropout_add_layer_norm):
// on CUDA in float32, as autocast runs torch's layer_norm there. On CPU in the wider dtype of x
// and (the fused op's) residual, whose sum eager promotes, with float32 gamma and beta left
// float32: torch's CPU layer_norm returns a bf16 x's norm in bf16 computed with the unrounded
// parameters (the saved output stays 2 bytes), and an fp32 residual stream's in fp32. The
// fused op's bias (the previous Linear's) takes that dtype, as the Linear's output has it.
// Attention in the autocast dtype, as scaled_dot_product_attention; the gated MLP too, as
// autocast runs its three linears; the activations' x and
// bias promoted to the wider of the two. linear_cross_entropy's head GEMM in the autocast dtype
// (as autocast runs the LM head's linear) and its loss in float32 (as autocast's cross_entropy
// returns it): hidden, weight and bias cast (float64 left as it is, as autocast leaves it), the
// op's dtype argument float32 unless the caller set it; the logits are reduced in fp32 either way;
// qkv_split's bias cast to z's dtype, as linear's bias is. Each kernel casts the floating
// tensor arguments and calls the op again with autocast off.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

namespace tempo {
namespace {

enum class Cast { kFloat32, kLikeX, kNormOnCpu, kLowerPrecision, kPromote };

// A norm's own parameters: weight, beta, and layer_norm's bias (its beta; the fused op's
// bias is the previous Linear's, added to x before the norm).
bool norm_parameter(const c10::FunctionSchema& schema, size_t i) {
  const std::string& name = schema.arguments()[i].name();
  return name == "weight" || name == "beta" ||
         (name == "bias" && schema.name() != "tempo::bias_dropout_add_layer_norm");
}

// The data a norm's dtype follows: x, and the fused op's residual.
bool norm_data(const c10::FunctionSchema& schema, size_t i) {
  const std::string& name = schema.arguments()[i].name();
  return name == "x" || name == "residual";
}

template <Cast policy, c10::DeviceType device>
void autocast_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const size_t begin = stack->size() - n;
  c10::ScalarType target = at::kFloat;
  if (policy == Cast::kLowerPrecision) {
    target = at::autocast::get_autocast_dtype(device);
  } else if (policy == Cast::kLikeX) {
    target = (*stack)[begin].toTensor().scalar_type();
  } else if (policy == Cast::kPromote || policy == Cast::kNormOnCpu) {
    bool first = true;
    for (size_t i = begin; i < stack->size(); ++i)
      if (const auto& a = (*stack)[i]; a.isTensor() && a.toTensor().defined() && a.toTensor().is_floating_point() &&
                                       (policy == Cast::kPromote || norm_data(op.schema(), i - begin))) {
        target = first ? a.toTensor().scalar_type() : at::promote_types(target, a.toTensor().scalar_type());
        first = false;
      }
  }
  const bool low_precision = target == at::kBFloat16 || target == at::kHalf;
  for (size_t i = begin; i < stack->size(); ++i)
    if (auto& a = (*stack)[i]; a.isTensor()) {
      const at::Tensor& t = a.toTensor();
      if (!t.defined() || !t.is_floating_point() || t.scalar_type() == target) continue;
      if (policy == Cast::kNormOnCpu && low_precision && t.scalar_type() == at::kFloat &&
          norm_parameter(op.schema(), i - begin))
        continue;  // float32 gamma / beta under 16-bit data: the op takes them as they are
      a = t.to(target);
    }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  op.callBoxed(stack);
}

// linear_cross_entropy under autocast (see the top of the file).
template <c10::DeviceType device>
void linear_cross_entropy_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t begin = stack->size() - n;
  const c10::ScalarType target = at::autocast::get_autocast_dtype(device);
  for (size_t i = begin; i < stack->size(); ++i) {
    auto& a = (*stack)[i];
    const std::string& name = schema.arguments()[i - begin].name();
    if (a.isTensor() && (name == "hidden" || name == "weight" || name == "bias")) {
      const at::Tensor& t = a.toTensor();
      if (t.defined() && t.is_floating_point() && t.scalar_type() != at::kDouble && t.scalar_type() != target)
        a = t.to(target);
    } else if (name == "dtype" && a.isNone()) {
      a = c10::IValue(static_cast<int64_t>(at::kFloat));
    }
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  op.callBoxed(stack);
}

template <c10::DeviceType device>
void register_autocast(torch::Library& m) {
  constexpr Cast norms = device == c10::DeviceType::CUDA ? Cast::kFloat32 : Cast::kNormOnCpu;
  for (const char* name : {"layer_norm", "rms_norm", "bias_dropout_add_layer_norm"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<norms, device>>());
  for (const char* name : {"attention", "fused_attention", "gated_mlp"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<Cast::kLowerPrecision, device>>());
  for (const char* name : {"gelu", "silu"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<Cast::kPromote, device>>());
  for (const char* name : {"linear_cross_entropy", "linear_cross_entropy_stats"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&linear_cross_entropy_autocast<device>>());
  m.impl("qkv_split", torch::CppFunction::makeFromBoxedFunction<&autocast_kernel<Cast::kLikeX, device>>());
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, AutocastCPU, m) { tempo::register_autocast<c10::DeviceType::CPU>(m); }
TORCH_LIBRARY_IMPL(tempo, AutocastCUDA, m) { tempo::register_autocast<c10::DeviceType::CUDA>(m); }
