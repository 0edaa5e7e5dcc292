// In-place activations (GELU erf/tanh, SiLU): the forward keeps the output and one bit per
// element, m = [x >= x*] with x* the activation's argmin; the backward recovers f'(x) from
// (y, m). Kernel core API: plain parameters, caller-allocated outputs, explicit stream.
#pragma once

#include "tempo/common.h"

namespace tempo {

enum class Activation : int32_t { kGeluErf = 0, kGeluTanh = 1, kSilu = 2 };

const char* activation_name(Activation act);

struct ActivationForwardParams {
  Activation act = Activation::kGeluErf;
  DType dtype = DType::kFloat32;
  const void* x = nullptr;     // numel elements, contiguous
  const void* bias = nullptr;  // optional: bias_size elements, added along the last dim
  int64_t bias_size = 0;       // numel must be a multiple of it
  void* y = nullptr;           // out: numel elements, f(x + bias)
  uint8_t* mask = nullptr;     // out: bit_mask_bytes(numel) bytes
  int64_t numel = 0;
};

struct ActivationBackwardParams {
  Activation act = Activation::kGeluErf;
  DType dtype = DType::kFloat32;
  const void* y = nullptr;        // the forward output
  const uint8_t* mask = nullptr;  // the forward mask
  const void* grad_y = nullptr;
  void* grad_x = nullptr;  // out: grad_y * f'(f^-1(y, m)); may alias grad_y
  int64_t numel = 0;
  // Optional, the bias gradient fused into the same pass (Ivanov et al.'s "bdrb"): the sum of
  // grad_x over all but the last dim, bias_size columns (numel a multiple of it), accumulated
  // in double (fp64 data) or fp32 (CUDA) / double (CPU) and stored in dtype.
  void* grad_bias = nullptr;
  int64_t bias_size = 0;
  // Scratch of the CUDA bias gradient: activation_backward_workspace_elems(numel, bias_size)
  // elements of the math type (fp32, fp64 for fp64 data).
  void* workspace = nullptr;
};

// The CUDA backward with a bias gradient runs at most this many row groups, each writing one
// partial row of the column sums into the workspace.
constexpr int64_t kActivationBiasGroups = 256;
int64_t activation_backward_workspace_elems(int64_t numel, int64_t bias_size);

Status activation_forward_cpu(const ActivationForwardParams& p);
Status activation_backward_cpu(const ActivationBackwardParams& p);

// `stream` is a cudaStream_t. Without CUDA in the build these return an error.
Status activation_forward_cuda(const ActivationForwardParams& p, void* stream);
Status activation_backward_cuda(const ActivationBackwardParams& p, void* stream);

namespace detail {
Status validate(const ActivationForwardParams& p);
Status validate(const ActivationBackwardParams& p);
// Tests: cap the CPU kernels' SIMD code paths (0: scalar only, 1: up to AVX2, 2: up to
// AVX-512; the best one the processor has within the cap runs). Returns the previous cap.
int set_cpu_simd(int max_level);
}  // namespace detail

}  // namespace tempo
