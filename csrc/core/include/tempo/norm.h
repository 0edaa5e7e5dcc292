// In-place LayerNorm and RMSNorm: the forward keeps y (which the next layer keeps anyway)
// and one fp32 rstd per row (fp64 for fp64 data); the backward recovers xhat = (y - beta) / gamma from y.
// Columns where that recovery would lose precision (|gamma| tiny, 0 or subnormal, or |beta|
// large against |gamma|: norm_column_recoverable) are "kept": the forward also writes their
// xhat (rows x kept, math type) and the backward reads it, so every column is exact.
// LayerNorm may run fused behind bias + dropout + residual (Ivanov et al.'s "bdrln"):
// h = residual + dropout(x + bias), y = LayerNorm(h), in one pass that also writes the
// dropout bits; its backward returns the gradients of x, bias and residual too. Names as in
// tempo::bias_dropout_add_layer_norm: `bias` is added before dropout, `beta` is LayerNorm's
// shift (torch's layer_norm calls that one bias).
#pragma once

#include "tempo/common.h"
#include "tempo/dropout.h"

namespace tempo {

enum class NormKind : int32_t { kLayerNorm = 0, kRmsNorm = 1 };
const char* norm_name(NormKind kind);

// The column rule. Recovering xhat = (y - beta) / gamma from the rounded y errs by about
// u (|xhat| + |beta / gamma|) + tiny / |gamma| (u: half an ulp of the dtype; tiny: half its
// smallest subnormal). A column is recovered from y when gamma and beta are finite,
// |gamma| >= the dtype's smallest normal number and |beta| <= norm_recovery_ratio(dtype) |gamma|,
// so that the recovery error stays at a few u of xhat; otherwise it is kept.
double norm_recovery_ratio(DType dtype);
double norm_gamma_min(DType dtype);
bool norm_column_recoverable(DType dtype, double gamma, double beta);
// The kept columns of a norm over data of `dtype` with these parameters (host pointers of
// `param_dtype`, either may be null: gamma 1, beta 0), ascending, written to `out` (room for
// `cols`); returns their number. The rule is the data's: recovery reads the rounded y.
int64_t norm_kept_columns(DType dtype, DType param_dtype, const void* weight, const void* bias, int64_t cols,
                          int64_t* out);

// Parameters: weight and beta (and grad_weight, grad_beta) are of the data's dtype, or float32
// for bfloat16/float16 data when float_params is set (as torch's CPU layer_norm takes them,
// and autocast leaves them): then gamma and beta enter the math unrounded. The prologue's
// bias is always of the data's dtype (it is the previous Linear's, added before rounding).

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
  const void* beta = nullptr;    // optional: cols (LayerNorm only)
  bool float_params = false;     // weight and beta are float32 (16-bit data only)
  NormPrologue prologue;         // LayerNorm only
  void* y = nullptr;             // out: rows x cols
  void* rstd = nullptr;          // out: rows, fp32 (fp64 for fp64 data)
  uint8_t* mask = nullptr;       // out when prologue.p > 0 in bits mode: bit_mask_bytes(rows * cols)
  // Kept columns: kept_slot[j] is column j's index among the kept ones, or -1 (cols entries;
  // may be null when kept == 0). kept_xhat: out, rows x kept, math type (fp32, fp64 for fp64).
  const int32_t* kept_slot = nullptr;
  int64_t kept = 0;
  void* kept_xhat = nullptr;
  int64_t rows = 0, cols = 0;
  double eps = 1e-5;
};

struct NormBackwardParams {
  NormKind kind = NormKind::kLayerNorm;
  DType dtype = DType::kFloat32;
  const void* grad_y = nullptr;
  const void* y = nullptr;
  const void* rstd = nullptr;  // fp32 (fp64 for fp64 data)
  const void* weight = nullptr;
  const void* beta = nullptr;
  bool float_params = false;  // weight, beta, grad_weight and grad_beta are float32 (16-bit data only)
  // The prologue's p, mode and rng as in the forward (residual and bias are not read): it is
  // enabled by grad_residual, its bias gradient by grad_bias.
  NormPrologue prologue;
  const uint8_t* mask = nullptr;  // the forward's dropout bits (bits mode)
  void* grad_x = nullptr;         // out: rows x cols
  void* grad_weight = nullptr;    // out when weight: cols
  void* grad_beta = nullptr;      // out when beta: cols
  void* grad_residual = nullptr;  // out, enables the prologue: rows x cols (the gradient of h)
  void* grad_bias = nullptr;      // out, optional with the prologue: cols
  // The forward's kept columns and their xhat (as NormForwardParams), read here.
  const int32_t* kept_slot = nullptr;
  int64_t kept = 0;
  const void* kept_xhat = nullptr;
  // Scratch for the column sums (CUDA only): norm_backward_workspace_elems(rows, cols)
  // elements of the math type (fp32, fp64 for fp64 data).
  void* workspace = nullptr;
  int64_t rows = 0, cols = 0;
};

// The CUDA backward runs at most this many row groups (blocks), each writing one partial row
// of the column sums into the workspace.
constexpr int64_t kNormBackwardGroups = 512;
// Scratch the CUDA backward needs for its per-block column partial sums, in elements.
int64_t norm_backward_workspace_elems(int64_t rows, int64_t cols);

Status norm_forward_cpu(const NormForwardParams& p);
Status norm_backward_cpu(const NormBackwardParams& p);
Status norm_forward_cuda(const NormForwardParams& p, void* stream);
Status norm_backward_cuda(const NormBackwardParams& p, void* stream);

namespace detail {
Status validate(const NormForwardParams& p);
Status validate(const NormBackwardParams& p);
// Every column the backward would recover from y is recoverable (host parameters): a column
// that is not, and not kept, is an error rather than a silently wrong gradient.
Status check_kept_columns(const NormBackwardParams& p);
}  // namespace detail

}  // namespace tempo
