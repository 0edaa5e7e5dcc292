// In-place LayerNorm and RMSNorm: the forward keeps y (which the next layer keeps anyway)
// and one fp32 rstd per row (fp64 for fp64 data); the backward recovers xhat = (y - beta) / gamma from y.
// LayerNorm may run fused behind bias + dropout + residual (Ivanov et al.'s "bdrln"):
// h = residual + dropout(x + pre_bias), y = LayerNorm(h), in one pass that also writes
// the dropout bits; its backward returns the gradients of x, pre_bias and residual too.
#pragma once

#include "tempo/common.h"
#include "tempo/dropout.h"

namespace tempo {

enum class NormKind : int32_t { kLayerNorm = 0, kRmsNorm = 1 };
const char* norm_name(NormKind kind);

// Recovering xhat divides by gamma. |gamma| is clamped from below to this value (keeping
// its sign, +kNormGammaMin for 0), and the recovered xhat is clamped to the range every
// normalised value lies in, |xhat| <= sqrt(cols): the backward never divides by zero and
// never emits inf/NaN from finite input. Where |gamma| >= kNormGammaMin the xhat error is
// at most u(y) / |gamma| (u: half an ulp of y's dtype), otherwise at most sqrt(cols) + |xhat|.
constexpr float kNormGammaMin = 1e-12f;

// The bias-dropout-residual stage in front of a LayerNorm (all optional together: set
// `residual` to enable it).
struct NormPrologue {
  const void* residual = nullptr;  // rows x cols, the residual added after dropout
  const void* bias = nullptr;      // optional: cols, added to x before dropout
  double p = 0.0;                  // dropout probability; 0: no dropout
  DropoutMode mode = DropoutMode::kBits;
  PhiloxState rng;
};

struct NormForwardParams {
  NormKind kind = NormKind::kLayerNorm;
  DType dtype = DType::kFloat32;
  const void* x = nullptr;       // rows x cols, contiguous
  const void* weight = nullptr;  // optional: cols (gamma)
  const void* bias = nullptr;    // optional: cols (beta; LayerNorm only)
  NormPrologue prologue;         // LayerNorm only
  void* y = nullptr;             // out: rows x cols
  void* rstd = nullptr;          // out: rows, fp32 (fp64 for fp64 data)
  uint8_t* mask = nullptr;       // out when prologue.p > 0 in bits mode: dropout_mask_bytes(rows * cols)
  int64_t rows = 0, cols = 0;
  double eps = 1e-5;
};

struct NormBackwardParams {
  NormKind kind = NormKind::kLayerNorm;
  DType dtype = DType::kFloat32;
  const void* grad_y = nullptr;
  const void* y = nullptr;
  const void* rstd = nullptr;     // fp32 (fp64 for fp64 data)
  const void* weight = nullptr;
  const void* bias = nullptr;
  // The prologue's p, mode and rng as in the forward (residual and bias are not read): it is
  // enabled by grad_residual, its bias gradient by grad_pre_bias.
  NormPrologue prologue;
  const uint8_t* mask = nullptr;   // the forward's dropout bits (bits mode)
  void* grad_x = nullptr;          // out: rows x cols
  void* grad_weight = nullptr;     // out when weight: cols
  void* grad_bias = nullptr;       // out when bias: cols
  void* grad_residual = nullptr;   // out, enables the prologue: rows x cols (the gradient of h)
  void* grad_pre_bias = nullptr;   // out, optional with the prologue: cols
  // Scratch for the column sums (CUDA only): norm_backward_workspace_elems(rows, cols)
  // elements of the math type (fp32, fp64 for fp64 data).
  void* workspace = nullptr;
  int64_t rows = 0, cols = 0;
};

// Scratch the CUDA backward needs for its per-block column partial sums, in elements.
int64_t norm_backward_workspace_elems(int64_t rows, int64_t cols);

Status norm_forward_cpu(const NormForwardParams& p);
Status norm_backward_cpu(const NormBackwardParams& p);
Status norm_forward_cuda(const NormForwardParams& p, void* stream);
Status norm_backward_cuda(const NormBackwardParams& p, void* stream);

namespace detail {
Status validate(const NormForwardParams& p);
Status validate(const NormBackwardParams& p);
}  // namespace detail

}  // namespace tempo
