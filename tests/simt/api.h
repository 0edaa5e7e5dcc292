// The core's CUDA entry points, run by the host emulator (tests/simt/cuda_runtime.h). They are
// compiled in a namespace of their own (the build defines tempo=tempo_simt for those sources,
// so the CPU kernels and the emulated CUDA ones, which share the math headers, never mix), and
// reached here by name: translate.py registers every `Status <entry>_cuda(const Params&, void*)`
// a .cu defines, and call("<entry>", &params) runs it on a pointer to the tempo:: struct its
// declaration names, returning "" or the Status's message.
#pragma once

#include <cstdint>
#include <string>

namespace simt_api {

// call("rope_forward", &p): tempo::rope_forward_cuda(p) in the emulator; an entry no
// translated source registered gives a message saying so.
std::string call(const std::string& entry, const void* params);

using Entry = std::string (*)(const void* params);
bool register_entry(const char* name, Entry fn);  // by the translated sources (translate.py)

// philox_state_store_cuda: (seed, offset) of a PhiloxState into out[0], out[1].
std::string philox_state_store(const void* state, uint64_t* out);

// What the emulator ran since the process started: blocks, __syncthreads released, warp shuffles.
struct Counters {
  uint64_t blocks, barriers, shuffles;
};
Counters counters();

}  // namespace simt_api
