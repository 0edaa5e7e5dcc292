// CUDA kernels of dropout: one thread per mask byte (8 elements, moved as 16-byte words when
// aligned, a scalar tail), grid-stride, 64-bit indexing. The keep bits are the same Philox draws as on the CPU
// (math/philox.h).
#include "tempo/dropout.h"
#include "../math/philox.h"
#include "common.cuh"

namespace tempo {
namespace {

// vec: x and y (dy and dx) 16-byte aligned, so that whole groups of 8 move as 16-byte words.
template <typename T>
__global__ void dropout_forward_kernel(DropoutForwardParams p, uint64_t threshold, DropoutScale scale, bool vec) {
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const PhiloxState rng = cuda::resolve(p.rng);
  const int64_t bytes = bit_mask_bytes(p.numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    uint32_t bits = math::keep_byte(rng.seed, rng.offset, b, threshold);
    const int64_t i0 = b * 8;
    const int64_t valid = p.numel - i0;
    if (valid < 8) bits &= (1u << valid) - 1u;
    cuda::Pack8<T> in, out;
    cuda::load8(x, i0, p.numel, vec, in);
#pragma unroll
    for (int q = 0; q < 8; ++q) math::store(&out.v[q], scale.apply(math::to_float(in.v[q]), ((bits >> q) & 1u) != 0));
    cuda::store8(y, i0, p.numel, vec, out);
    if (p.mask) p.mask[b] = static_cast<uint8_t>(bits);
  }
}

template <typename T>
__global__ void dropout_backward_kernel(DropoutBackwardParams p, uint64_t threshold, DropoutScale scale, bool vec) {
  const T* dy = static_cast<const T*>(p.grad_y);
  T* dx = static_cast<T*>(p.grad_x);
  const PhiloxState rng = cuda::resolve(p.rng);
  const int64_t bytes = bit_mask_bytes(p.numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    const uint32_t bits = p.mask ? p.mask[b] : math::keep_byte(rng.seed, rng.offset, b, threshold);
    const int64_t i0 = b * 8;
    cuda::Pack8<T> in, out;
    cuda::load8(dy, i0, p.numel, vec, in);
#pragma unroll
    for (int q = 0; q < 8; ++q) math::store(&out.v[q], scale.apply(math::to_float(in.v[q]), ((bits >> q) & 1u) != 0));
    cuda::store8(dx, i0, p.numel, vec, out);
  }
}

__global__ void dropout_philox_state_store_kernel(PhiloxState rng, uint64_t* out) {
  const PhiloxState s = cuda::resolve(rng);
  out[0] = s.seed;
  out[1] = s.offset;
}

}  // namespace

Status philox_state_store_cuda(const PhiloxState& rng, uint64_t* out, void* stream) {
  if (!out) return Status::Error("philox state store: out must be non-null");
  dropout_philox_state_store_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(rng, out);
  return cuda::launch_status("philox state store");
}

bool cuda_stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not a stream we can ask about: not capturing
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

Status dropout_forward_cuda(const DropoutForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const int grid = cuda::grid_for(bit_mask_bytes(p.numel));
  const bool vec = cuda::aligned16(p.x) && cuda::aligned16(p.y);
  math::by_dtype(p.dtype, [&](auto t) {
    dropout_forward_kernel<decltype(t)>
        <<<grid, cuda::kThreads, 0, st>>>(p, math::keep_threshold(p.p), DropoutScale(p.p), vec);
  });
  return cuda::launch_status("dropout forward");
}

Status dropout_backward_cuda(const DropoutBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const int grid = cuda::grid_for(bit_mask_bytes(p.numel));
  const bool vec = cuda::aligned16(p.grad_y) && cuda::aligned16(p.grad_x);
  math::by_dtype(p.dtype, [&](auto t) {
    dropout_backward_kernel<decltype(t)>
        <<<grid, cuda::kThreads, 0, st>>>(p, math::keep_threshold(p.p), DropoutScale(p.p), vec);
  });
  return cuda::launch_status("dropout backward");
}

}  // namespace tempo
