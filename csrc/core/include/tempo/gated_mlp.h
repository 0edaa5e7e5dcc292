// The gated MLP's elementwise part, h = act(gate) * up (SwiGLU with SiLU, GeGLU with the erf or
// tanh GELU), and its backward from what the op keeps: the gate and up projections, not h, not
// act(gate). The backward reads gate, up and dL/dh and writes dL/dgate, dL/dup and, for the
// down projection's weight gradient, h again (the same bits as the forward's on one device).
// Gate and up are row-strided so that one fused gate_up projection ([rows, 2 cols], gate first)
// is read in place. Kernel core API: plain parameters, caller-allocated outputs, explicit stream.
#pragma once

#include "tempo/activation.h"
#include "tempo/common.h"

namespace tempo {

struct GatedMlpForwardParams {
  Activation act = Activation::kSilu;
  DType dtype = DType::kFloat32;
  const void* gate = nullptr;  // rows x cols, row stride gate_stride elements
  const void* up = nullptr;    // rows x cols, row stride up_stride elements
  int64_t rows = 0, cols = 0;
  int64_t gate_stride = 0, up_stride = 0;
  void* h = nullptr;  // out: rows x cols, contiguous
};

struct GatedMlpBackwardParams {
  Activation act = Activation::kSilu;
  DType dtype = DType::kFloat32;
  const void* gate = nullptr;
  const void* up = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t gate_stride = 0, up_stride = 0;
  const void* grad_h = nullptr;  // rows x cols, contiguous
  void* grad_gate = nullptr;     // out: grad_h * up * act'(gate), row stride grad_gate_stride
  void* grad_up = nullptr;       // out: grad_h * act(gate), row stride grad_up_stride
  int64_t grad_gate_stride = 0, grad_up_stride = 0;
  void* h = nullptr;  // optional out: act(gate) * up, rows x cols contiguous (the forward's value)
};

// Accuracy (tests/cpp/core/test_gated_mlp.cpp, tests/python/ops/test_gated_mlp.py):
//   CPU: act(g) and act'(g) evaluated in double (relative error under 1e-9; the C library's
//   functions for fp64 data), each output a product rounded once to fp32 (then to a 16-bit
//   type): within 0.5 ulp + 1e-9 relative of the exact h, dL/dup; dL/dgate within that of
//   grad_h * up * (|f1| + |f2|), where act' = f1 + f2 is the sum the derivative is made of
//   (it cancels near act's minimum, where act' is 0).
//   CUDA, 16/32-bit data: the same forms in fp32 with the device's expf / erfcf: within
//   kGatedMlpCudaUlps ulps of fp32 in those terms, plus the amplification of the fp32 rounding
//   of the exponential's or erfc's argument in the tails (math/gated_mlp_math.h,
//   gate_f32_ulps: 2 |z| or 1.5 g^2 ulps more), where the values vanish; fp64 as on the CPU.
inline constexpr double kGatedMlpCudaUlps = 16.0;

Status gated_mlp_forward_cpu(const GatedMlpForwardParams& p);
Status gated_mlp_backward_cpu(const GatedMlpBackwardParams& p);

// `stream` is a cudaStream_t. Without CUDA in the build these return an error.
Status gated_mlp_forward_cuda(const GatedMlpForwardParams& p, void* stream);
Status gated_mlp_backward_cuda(const GatedMlpBackwardParams& p, void* stream);

namespace detail {
Status validate(const GatedMlpForwardParams& p);
Status validate(const GatedMlpBackwardParams& p);
}  // namespace detail

}  // namespace tempo
