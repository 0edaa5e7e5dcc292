// The core's CUDA entry points, run by the host emulator (tests/simt/cuda_runtime.h). They are
// compiled in a namespace of their own (the build defines tempo=tempo_simt for those sources,
// so the CPU kernels and the emulated CUDA ones, which share the math headers, never mix), and
// reached here through the same parameter structs passed by address: each function takes a
// pointer to the tempo:: struct its name says and returns "" or the Status's message.
#pragma once

#include <cstdint>
#include <string>

namespace simt_api {

#define SIMT_API_ENTRY(name) std::string name(const void* params);
SIMT_API_ENTRY(activation_forward)
SIMT_API_ENTRY(activation_backward)
SIMT_API_ENTRY(dropout_forward)
SIMT_API_ENTRY(dropout_backward)
SIMT_API_ENTRY(norm_forward)
SIMT_API_ENTRY(norm_backward)
SIMT_API_ENTRY(qkv_split_forward)
SIMT_API_ENTRY(qkv_split_backward)
SIMT_API_ENTRY(rope_forward)
SIMT_API_ENTRY(rope_backward)
SIMT_API_ENTRY(attention_softmax_forward)
SIMT_API_ENTRY(attention_softmax_backward)
SIMT_API_ENTRY(linear_attention_forward)
SIMT_API_ENTRY(linear_attention_backward)
SIMT_API_ENTRY(linear_cross_entropy_forward)
SIMT_API_ENTRY(linear_cross_entropy_backward)
SIMT_API_ENTRY(gated_mlp_forward)
SIMT_API_ENTRY(gated_mlp_backward)
#undef SIMT_API_ENTRY

// philox_state_store_cuda: (seed, offset) of a PhiloxState into out[0], out[1].
std::string philox_state_store(const void* state, uint64_t* out);

// What the emulator ran since the process started: blocks, __syncthreads released, warp shuffles.
struct Counters {
  uint64_t blocks, barriers, shuffles;
};
Counters counters();

}  // namespace simt_api
