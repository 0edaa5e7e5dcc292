// Helpers shared by the CUDA kernels of the core: launch checks, grid sizes, dtype dispatch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "tempo/common.h"
#include "tempo/dropout.h"
#include "../math/numeric.h"
#include "../math/philox.h"

namespace tempo::cuda {

constexpr int kThreads = 256;

inline Status launch_status(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::Error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(err));
  return Status::Ok();
}

// Blocks for `items` work items of one thread each, capped for grid-stride loops.
inline int grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1 << 16)));
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// f(T{}) with T the storage type of dtype.
template <typename F>
void by_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat64: f(double{}); break;
    case DType::kBFloat16: f(math::bf16_t{}); break;
    case DType::kFloat16: f(math::fp16_t{}); break;
  }
}

// The Philox state with (seed, offset) loaded from device memory when it lives there.
__device__ inline PhiloxState resolve(PhiloxState s) {
  if (s.device) {
    s.seed = s.device[0];
    s.offset = s.device[1];
  }
  return s;
}

namespace {
// The packed Philox keep bits of elements 0 .. numel-1 (bits past the end are zero), one
// thread per mask byte, for the kernels that store them (bits mode).
__global__ void keep_bits_kernel(PhiloxState rng, uint8_t* bits, int64_t numel, uint64_t threshold) {
  const PhiloxState s = resolve(rng);
  const int64_t bytes = dropout_mask_bytes(numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    uint32_t v = math::keep_byte(s.seed, s.offset, b, threshold);
    const int64_t valid = numel - b * 8;
    if (valid < 8) v &= (1u << valid) - 1u;
    bits[b] = static_cast<uint8_t>(v);
  }
}
}  // namespace

}  // namespace tempo::cuda
