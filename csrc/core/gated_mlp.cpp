// Backend-independent parts of the gated MLP's elementwise kernels: parameter validation.
#include "tempo/gated_mlp.h"

#include <string>

namespace tempo::detail {

namespace {
bool known(Activation act) {
  return act == Activation::kGeluErf || act == Activation::kGeluTanh || act == Activation::kSilu;
}
bool known(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kBFloat16 || d == DType::kFloat16;
}

Status check_shape(Activation act, DType dtype, int64_t rows, int64_t cols, int64_t gate_stride, int64_t up_stride,
                   const char* what) {
  const std::string w(what);
  TEMPO_CORE_CHECK(known(act), w + ": unknown activation");
  TEMPO_CORE_CHECK(known(dtype), w + ": unsupported dtype");
  TEMPO_CORE_CHECK(rows >= 0 && cols >= 0, w + ": rows and cols must be non-negative");
  TEMPO_CORE_CHECK(numel_fits({rows, cols}), w + ": rows * cols is too large");
  TEMPO_CORE_CHECK(gate_stride >= cols && up_stride >= cols, w + ": row strides must be at least cols");
  TEMPO_CORE_CHECK(numel_fits({rows, gate_stride}) && numel_fits({rows, up_stride}), w + ": a row stride is too large");
  return Status::Ok();
}
}  // namespace

Status validate(const GatedMlpForwardParams& p) {
  Status s = check_shape(p.act, p.dtype, p.rows, p.cols, p.gate_stride, p.up_stride, "gated_mlp forward");
  if (!s.ok() || p.rows == 0 || p.cols == 0) return s;
  TEMPO_CORE_CHECK(p.gate && p.up && p.h, "gated_mlp forward: gate, up and h must be non-null");
  return Status::Ok();
}

Status validate(const GatedMlpBackwardParams& p) {
  Status s = check_shape(p.act, p.dtype, p.rows, p.cols, p.gate_stride, p.up_stride, "gated_mlp backward");
  if (!s.ok() || p.rows == 0 || p.cols == 0) return s;
  TEMPO_CORE_CHECK(p.gate && p.up && p.grad_h && p.grad_gate && p.grad_up,
                   "gated_mlp backward: gate, up, grad_h, grad_gate and grad_up must be non-null");
  TEMPO_CORE_CHECK(p.grad_gate_stride >= p.cols && p.grad_up_stride >= p.cols,
                   "gated_mlp backward: gradient row strides must be at least cols");
  TEMPO_CORE_CHECK(numel_fits({p.rows, p.grad_gate_stride}) && numel_fits({p.rows, p.grad_up_stride}),
                   "gated_mlp backward: a gradient row stride is too large");
  return Status::Ok();
}

}  // namespace tempo::detail

namespace tempo {
TEMPO_CUDA_UNAVAILABLE(gated_mlp_forward_cuda, GatedMlpForwardParams, "gated_mlp forward")
TEMPO_CUDA_UNAVAILABLE(gated_mlp_backward_cuda, GatedMlpBackwardParams, "gated_mlp backward")
}  // namespace tempo
