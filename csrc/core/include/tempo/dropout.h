// Dropout with a 1-bit packed mask, or with no stored mask at all: the keep bit of element i
// is drawn by Philox from (seed, offset, i) (math/philox.h), so "bits" mode stores it packed
// and "philox" mode regenerates it in backward. y = x * keep / (1 - p), p = 1 gives zeros.
// The same (seed, offset) gives the same mask on CPU and CUDA.
#pragma once

#include <cmath>

#include "tempo/common.h"

namespace tempo {

// kBits: the forward writes the packed keep bits to the mask and the backward reads them;
// kPhilox: no mask at all (it must be null), both draw the bits from the Philox state.
enum class DropoutMode : int32_t { kBits = 0, kPhilox = 1 };

// Where the keep bits come from: Philox key `seed`, counter high word `offset`.
// CUDA kernels read (seed, offset) from `device`, when set, instead of the two fields: the
// backward then needs no copy of the state to the host.
// In a CUDA graph being captured, (seed, offset) must be read when the kernel runs, not when
// it is recorded, or every replay would draw the same bits: `graph_seed` and `graph_offset`
// point to a generator's seed and offset in device memory (PyTorch's CUDA generator keeps them
// there while a graph is captured and rewrites them before each replay), and the kernels use
// seed = *graph_seed ^ kGraphSeedDomain, offset = *graph_offset + graph_offset_add.
struct PhiloxState {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const uint64_t* device = nullptr;     // CUDA only: {seed, offset} in device memory
  const int64_t* graph_seed = nullptr;  // CUDA only, in graph capture: see above
  const int64_t* graph_offset = nullptr;
  uint64_t graph_offset_add = 0;
};

// Mixed into a generator's seed read in a graph (above): tempo's Philox counters (element
// group, offset) are laid out unlike PyTorch's (offset, thread), so under the same key some of
// both would coincide; a key of tempo's own keeps the two streams apart.
constexpr uint64_t kGraphSeedDomain = 0x74656d706f647270ULL;  // "tempodrp"

// Writes the (seed, offset) that `rng` stands for, as the kernels read it, to out[0], out[1]
// in device memory (stream order): the state a philox-mode backward reads from `device`.
// Under graph capture the write is recorded, so each replay stores that replay's state.
Status philox_state_store_cuda(const PhiloxState& rng, uint64_t* out, void* stream);

struct DropoutForwardParams {
  DType dtype = DType::kFloat32;
  const void* x = nullptr;  // numel elements, contiguous
  void* y = nullptr;        // out: numel elements
  DropoutMode mode = DropoutMode::kBits;
  uint8_t* mask = nullptr;  // out in bits mode: bit_mask_bytes(numel) packed keep bits
  double p = 0.5;           // drop probability in [0, 1]
  PhiloxState rng;
  int64_t numel = 0;
};

struct DropoutBackwardParams {
  DType dtype = DType::kFloat32;
  const void* grad_y = nullptr;
  void* grad_x = nullptr;  // out: grad_y * keep / (1 - p); may alias grad_y
  DropoutMode mode = DropoutMode::kBits;
  const uint8_t* mask = nullptr;  // bits mode: the forward's bits; philox mode: null (drawn from rng)
  double p = 0.5;
  PhiloxState rng;
  int64_t numel = 0;
};

Status dropout_forward_cpu(const DropoutForwardParams& p);
Status dropout_backward_cpu(const DropoutBackwardParams& p);
Status dropout_forward_cuda(const DropoutForwardParams& p, void* stream);
Status dropout_backward_cuda(const DropoutBackwardParams& p, void* stream);

// The scale applied to kept elements: 1 / (1 - p), and 0 for p = 1.
TEMPO_HD double dropout_scale(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }

// x * keep * scale rounded once (to within 2^-48 before the rounding): the scale in two
// floats (hi + lo), one fma, so fp32 math gives the float64 product's rounding without
// double arithmetic. Kept inf stays inf; dropped elements give x * 0 (NaN for non-finite x,
// as PyTorch's x * mask).
struct DropoutScale {
  float hi = 0.0f, lo = 0.0f;
  double full = 0.0;
  TEMPO_HD explicit DropoutScale(double p) {
    full = dropout_scale(p);
    hi = static_cast<float>(full);
    lo = static_cast<float>(full - static_cast<double>(hi));
  }
  TEMPO_HD float apply(float x, bool keep) const {
    const float a = x * hi;  // non-finite: the correction would turn inf into NaN
    return keep ? (fabsf(a) <= 3.402823466e38f ? fmaf(x, hi, x * lo) : a) : x * 0.0f;
  }
  TEMPO_HD double apply(double x, bool keep) const { return keep ? x * full : x * 0.0; }
};

namespace detail {
Status validate(const DropoutForwardParams& p);
Status validate(const DropoutBackwardParams& p);
// The mask agrees with the mode: present in bits mode (when anything is dropped), absent in
// philox mode. `what` names the caller in the error.
Status check_dropout_mask(DropoutMode mode, double p, const void* mask, const char* what);
}  // namespace detail

}  // namespace tempo
