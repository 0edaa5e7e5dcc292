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
// Grid caps for grid-stride loops: elementwise kernels (one thread an item) and row kernels
// (one block a row; 65535 also fits a y/z grid dimension should a kernel move rows there).
constexpr int64_t kMaxElementBlocks = 1 << 16;
constexpr int64_t kMaxRowBlocks = 65535;

inline Status launch_status(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::Error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(err));
  return Status::Ok();
}

// Blocks for `items` work items of one thread each, capped for grid-stride loops.
inline int grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, kMaxElementBlocks)));
}

// Blocks for `rows` rows of one block each, capped for grid-stride loops.
inline int row_grid(int64_t rows) { return static_cast<int>(std::max<int64_t>(1, std::min(rows, kMaxRowBlocks))); }

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// 8 consecutive elements of T, moved as 16-byte words when `vec` holds: 16-byte aligned, as
// the uint4 accesses need (T's own alignment would let a copy spilled to local memory fault).
template <typename T>
struct alignas(16) Pack8 {
  T v[8];
};

// 8 elements at base + i0 as 16-byte words, for callers that know they are inside the tensor
// and 16-byte aligned (the row-in-registers kernels): no scalar fallback beside them.
template <typename T>
__device__ __forceinline__ void load8v(const T* base, int64_t i0, Pack8<T>& out) {
  constexpr int kWords = sizeof(T) * 8 / 16;
  const uint4* src = reinterpret_cast<const uint4*>(base + i0);
  uint4* dst = reinterpret_cast<uint4*>(out.v);
#pragma unroll
  for (int w = 0; w < kWords; ++w) dst[w] = src[w];
}

template <typename T>
__device__ __forceinline__ void store8v(T* base, int64_t i0, const Pack8<T>& in) {
  constexpr int kWords = sizeof(T) * 8 / 16;
  uint4* dst = reinterpret_cast<uint4*>(base + i0);
  const uint4* src = reinterpret_cast<const uint4*>(in.v);
#pragma unroll
  for (int w = 0; w < kWords; ++w) dst[w] = src[w];
}

// The same where `vec` (16-byte aligned) may not hold or the 8 may run past n elements: one
// element at a time there (zeros past the end on load).
template <typename T>
__device__ __forceinline__ void load8(const T* base, int64_t i0, int64_t n, bool vec, Pack8<T>& out) {
  if (vec && i0 + 8 <= n) {
    load8v(base, i0, out);
  } else {
#pragma unroll
    for (int q = 0; q < 8; ++q) out.v[q] = i0 + q < n ? base[i0 + q] : T{};
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* base, int64_t i0, int64_t n, bool vec, const Pack8<T>& in) {
  if (vec && i0 + 8 <= n) {
    store8v(base, i0, in);
  } else {
#pragma unroll
    for (int q = 0; q < 8; ++q)
      if (i0 + q < n) base[i0 + q] = in.v[q];
  }
}

// The Philox state with (seed, offset) loaded from device memory when it lives there: a
// generator's, in a captured graph (read at each replay), or a forward's stored state.
__device__ inline PhiloxState resolve(PhiloxState s) {
  if (s.graph_seed) {
    s.seed = static_cast<uint64_t>(*s.graph_seed) ^ kGraphSeedDomain;
    s.offset = static_cast<uint64_t>(*s.graph_offset) + s.graph_offset_add;
  } else if (s.device) {
    s.seed = s.device[0];
    s.offset = s.device[1];
  }
  return s;
}

// The sum (or the maximum) of v over the warp, returned to every lane.
template <bool Max = false, typename Acc>
__device__ __forceinline__ Acc warp_reduce(Acc v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const Acc u = __shfl_xor_sync(0xffffffffu, v, o);
    v = Max ? (u > v ? u : v) : v + u;
  }
  return v;
}

// The sum (or the maximum) of v over the block, returned to every thread; `shared` holds one
// value per warp (32) and is reused between calls. blockDim.x is a multiple of 32.
template <bool Max = false, typename Acc>
__device__ Acc block_reduce(Acc v, Acc* shared) {
  auto op = [](Acc a, Acc b) { return Max ? (b > a ? b : a) : a + b; };
  v = warp_reduce<Max>(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // shared is reused between calls
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  Acc total = shared[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) total = op(total, shared[w]);
  return total;
}

// Element e's dropout keep bit: read from the packed bits, or drawn by Philox (the same draw
// as keep_byte) when `bits` is null. `rng` is resolved by the caller.
__device__ inline bool keep_bit(const uint8_t* bits, const PhiloxState& rng, uint64_t threshold, int64_t e) {
  if (bits) return ((bits[e >> 3] >> (e & 7)) & 1u) != 0;
  const math::Philox4 r = math::philox_group(rng.seed, rng.offset, static_cast<uint64_t>(e >> 2));
  // (the word chosen by selects, not r.v[e & 3]: an array indexed at run time lives on the stack)
  const int q = static_cast<int>(e & 3);
  const uint32_t w = q == 0 ? r.v[0] : q == 1 ? r.v[1] : q == 2 ? r.v[2] : r.v[3];
  return static_cast<uint64_t>(w) < threshold;
}

namespace {
// The packed Philox keep bits of elements 0 .. numel-1 (bits past the end are zero), one
// thread per mask byte, for the kernels that store them (bits mode).
__global__ void keep_bits_kernel(PhiloxState rng, uint8_t* bits, int64_t numel, uint64_t threshold) {
  const PhiloxState s = resolve(rng);
  const int64_t bytes = bit_mask_bytes(numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    uint32_t v = math::keep_byte(s.seed, s.offset, b, threshold);
    const int64_t valid = numel - b * 8;
    if (valid < 8) v &= (1u << valid) - 1u;
    bits[b] = static_cast<uint8_t>(v);
  }
}

// The column sums of `groups` partial rows of M columns (parts[g M + c], the math type), added
// in group order and stored in T: the second stage of the kernels that sum a gradient over rows
// in fixed row groups (no atomics, so the same result on every run). One thread per column.
template <typename T>
__global__ void column_group_sums_kernel(const math::acc_t<T>* parts, int64_t groups, int64_t M, T* out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= M) return;
  math::acc_t<T> sum = 0;
  for (int64_t g = 0; g < groups; ++g) sum += parts[g * M + c];
  math::store(out + c, sum);
}
}  // namespace

}  // namespace tempo::cuda
