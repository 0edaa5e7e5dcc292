// A host stand-in for the part of CUDA that tempo's core kernels use, so that those kernels
// (csrc/core/cuda/*.cu, rewritten by tests/simt/translate.py) run on a machine without a GPU:
// each block's threads are fibers on one host thread, switched at __syncthreads and
// at warp shuffles, so every thread runs the kernel's own code with its own threadIdx.
//
// What it checks beyond the kernels' results: launch configurations a GPU refuses (block size,
// grid y/z, shared memory), __syncthreads reached at different places by the threads of a
// block, a full-mask warp shuffle with lanes that have exited or diverged, a block whose
// threads wait on each other forever, 16-byte vector accesses at unaligned addresses, and
// reads of dynamic shared memory the kernel never wrote (filled with NaN bytes) and writes past
// its end (guard bytes; the tests guard their tensors the same way). What it
// cannot check: the device's memory model (every access here is sequentially consistent and
// blocks run one after another, so races between blocks or threads go unseen), nvcc's code
// generation, and timing. Every failure aborts with a message: a test that sees one fails.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

// ---- the language: qualifiers and built-in variables ----------------------------------------
#define __global__
#define __device__
#define __launch_bounds__(...)
#define __host__
#define __constant__
#define __forceinline__ inline
#define __shared__ static  // blocks run one at a time, so a function's static is its block's

struct uint3 {
  unsigned int x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace simt {
[[noreturn]] inline void fail(const char* what, int line = 0) {
  if (line > 0)
    std::fprintf(stderr, "simt: %s (line %d of the kernel source)\n", what, line);
  else
    std::fprintf(stderr, "simt: %s\n", what);
  std::abort();
}
}  // namespace simt

// CUDA's uint4 is 16-byte aligned and moved as one 16-byte access: a copy from or to an
// address that is not a multiple of 16 is a misaligned-address fault on the device.
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
  uint4() = default;
  uint4(const uint4& o) { copy_from(o); }
  uint4& operator=(const uint4& o) {
    copy_from(o);
    return *this;
  }

 private:
  void copy_from(const uint4& o) {
    if (reinterpret_cast<uintptr_t>(this) % 16 || reinterpret_cast<uintptr_t>(&o) % 16)
      simt::fail("a 16-byte vector access at an address that is not a multiple of 16");
    std::memcpy(static_cast<void*>(this), &o, sizeof o);
  }
};

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

using std::max;
using std::min;

// ---- the runtime API the core calls ---------------------------------------------------------
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9 };
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };
using cudaStream_t = struct SimtStream*;

namespace simt {
inline cudaError_t g_last_error = cudaSuccess;
}  // namespace simt

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = simt::g_last_error;
  simt::g_last_error = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "invalid configuration argument";
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

// ---- the scheduler ---------------------------------------------------------------------------
namespace simt {

struct Fiber {
  ucontext_t ctx;      // the portable switch (not x86-64)
  void* sp = nullptr;  // the x86-64 switch: the saved stack pointer
  std::vector<char> stack;
  uint3 tid;
  enum State { kReady, kAtBarrier, kAtShuffle, kDone } state = kReady;
  int line = 0;        // where it waits
  uint64_t value = 0;  // a shuffle's operand, then its result
  int lane_arg = 0;    // a shuffle's xor mask
};

struct Launch {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  void* scheduler_sp = nullptr;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<unsigned char> dynamic_shared;
  // Counters for the tests: blocks run, barriers and shuffles completed.
  uint64_t blocks = 0, barriers = 0, shuffles = 0;
};
inline Launch g_launch;

// Switching between the scheduler and a thread. On x86-64 a few instructions that keep the
// callee-saved registers on the stack being left (glibc's swapcontext also saves the signal
// mask, a system call per switch, which made the tests 20 times slower); elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void simt_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .weak simt_switch
  .type simt_switch, @function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_switch, .-simt_switch
)");
constexpr bool kAsmSwitch = true;
#else
constexpr bool kAsmSwitch = false;
inline void simt_switch(void**, void*) {}
#endif

inline void to_scheduler(Fiber* f) {
  if (kAsmSwitch)
    simt_switch(&f->sp, g_launch.scheduler_sp);
  else
    swapcontext(&f->ctx, &g_launch.scheduler);
}
inline void to_fiber(Fiber* f) {
  if (kAsmSwitch)
    simt_switch(&g_launch.scheduler_sp, f->sp);
  else
    swapcontext(&g_launch.scheduler, &f->ctx);
}

inline void yield() { to_scheduler(g_launch.current); }

inline void fiber_entry() {
  (*g_launch.body)();
  g_launch.current->state = Fiber::kDone;
  to_scheduler(g_launch.current);
  fail("a finished thread was resumed");
}

// A fresh thread on f's stack, starting in fiber_entry.
inline void start_fiber(Fiber& f) {
  f.state = Fiber::kReady;
  if (kAsmSwitch) {
    // What simt_switch pops (six registers, then its return address), below a slot that
    // stands for fiber_entry's own return address: rsp is 8 mod 16 at its first instruction.
    auto top = (reinterpret_cast<uintptr_t>(f.stack.data()) + f.stack.size()) & ~uintptr_t{15};
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;
    *--sp = reinterpret_cast<void*>(&fiber_entry);
    for (int r = 0; r < 6; ++r) *--sp = nullptr;
    f.sp = sp;
  } else {
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
}

inline void syncthreads(int line) {
  Fiber* f = g_launch.current;
  f->state = Fiber::kAtBarrier;
  f->line = line;
  yield();
}

// A warp's 32 lanes each offer a value; lane l then gets the value of lane source(l).
inline uint64_t shuffle(uint64_t v, int arg, int line) {
  Fiber* f = g_launch.current;
  f->state = Fiber::kAtShuffle;
  f->line = line;
  f->value = v;
  f->lane_arg = arg;
  yield();
  return f->value;
}

// The order the scheduler runs threads in. kRoundRobin: every ready thread in turn, then the
// barriers and shuffles that all their threads reached. kWarpFirst / kWarpLast: one warp at a
// time, as far as it can go (its shuffles released at once), from the first warp or the last:
// a warp then runs ahead of the others into the next phase, so a missing barrier between a
// phase that reads shared memory and one that writes it changes the result.
enum class Schedule { kRoundRobin, kWarpFirst, kWarpLast };
inline Schedule g_schedule = [] {
  const char* s = std::getenv("SIMT_SCHEDULE");
  if (!s || !*s || !std::strcmp(s, "round-robin")) return Schedule::kRoundRobin;
  if (!std::strcmp(s, "warp-first")) return Schedule::kWarpFirst;
  if (!std::strcmp(s, "warp-last")) return Schedule::kWarpLast;
  fail("SIMT_SCHEDULE must be round-robin, warp-first or warp-last");
}();

// Releases warp w's shuffle if all 32 of its lanes wait at it; fails on lanes at different ones.
inline bool release_shuffle(unsigned w, unsigned threads) {
  Launch& L = g_launch;
  const unsigned lo = w * 32, hi = std::min(threads, lo + 32);
  unsigned waiting = 0;
  int line = -1;
  for (unsigned t = lo; t < hi; ++t) {
    const Fiber& f = L.fibers[t];
    if (f.state != Fiber::kAtShuffle) continue;
    if (line >= 0 && f.line != line) fail("lanes of one warp at different shuffles", f.line);
    line = f.line;
    ++waiting;
  }
  if (waiting == 0 || waiting != 32 || hi - lo != 32) return false;
  uint64_t in[32];
  for (unsigned t = lo; t < hi; ++t) in[t - lo] = L.fibers[t].value;
  for (unsigned t = lo; t < hi; ++t) {
    Fiber& f = L.fibers[t];
    const int lane = static_cast<int>(t - lo);
    f.value = in[(lane ^ f.lane_arg) & 31];  // as the device: the xor taken within the warp
    f.state = Fiber::kReady;
  }
  ++L.shuffles;
  return true;
}

// Runs threads [lo, hi) that are ready, each until it waits or ends; whether any ran.
inline bool run_ready(unsigned lo, unsigned hi) {
  Launch& L = g_launch;
  bool ran = false;
  for (unsigned t = lo; t < hi; ++t) {
    Fiber& f = L.fibers[t];
    if (f.state != Fiber::kReady) continue;
    L.current = &f;
    threadIdx = f.tid;
    to_fiber(&f);
    ran = true;
  }
  return ran;
}

// Runs the block's fibers until all are done; releases a barrier when every live thread of
// the block waits at it, a shuffle when all 32 lanes of a warp wait at it.
inline void run_block(unsigned threads) {
  Launch& L = g_launch;
  for (unsigned t = 0; t < threads; ++t) start_fiber(L.fibers[t]);
  const unsigned warps = (threads + 31) / 32;
  for (;;) {
    bool ran = false;
    if (g_schedule == Schedule::kRoundRobin) {
      ran = run_ready(0, threads);
    } else {
      for (unsigned i = 0; i < warps; ++i) {
        const unsigned w = g_schedule == Schedule::kWarpFirst ? i : warps - 1 - i;
        while (run_ready(w * 32, std::min(threads, w * 32 + 32)) || release_shuffle(w, threads)) ran = true;
      }
    }
    if (ran) continue;
    // Nothing runnable: release whatever every participant has reached.
    bool released = false;
    for (unsigned w = 0; w < warps; ++w) released = release_shuffle(w, threads) || released;
    if (released) continue;
    unsigned live = 0, at_barrier = 0, at_shuffle = 0;
    int barrier_line = -1, shuffle_line = -1;
    for (unsigned t = 0; t < threads; ++t) {
      const Fiber& f = L.fibers[t];
      if (f.state == Fiber::kDone) continue;
      ++live;
      if (f.state == Fiber::kAtShuffle) {
        ++at_shuffle;
        shuffle_line = f.line;
      }
      if (f.state == Fiber::kAtBarrier) {
        if (barrier_line >= 0 && f.line != barrier_line)
          fail("__syncthreads reached at different places by the threads of one block", f.line);
        barrier_line = f.line;
        ++at_barrier;
      }
    }
    if (live == 0) return;
    if (at_shuffle)
      fail("a full-mask warp shuffle without all 32 lanes (some have exited or wait elsewhere)", shuffle_line);
    if (at_barrier == live) {
      for (unsigned t = 0; t < threads; ++t)
        if (L.fibers[t].state == Fiber::kAtBarrier) L.fibers[t].state = Fiber::kReady;
      ++L.barriers;
      continue;
    }
    fail("the threads of a block wait on each other forever (a barrier some never reach)", barrier_line);
  }
}

constexpr size_t kSharedGuard = 256;

inline void launch(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  // The device's limits (compute capability 9.0): a launch beyond them fails, the kernel never runs.
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535 || shared_bytes > 48 * 1024) {
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  Launch& L = g_launch;
  if (L.fibers.size() < threads) {
    L.fibers.resize(threads);
    for (Fiber& f : L.fibers)
      if (f.stack.empty()) f.stack.resize(256 * 1024);
  }
  L.body = &body;
  gridDim = grid;
  blockDim = block;
  for (unsigned t = 0; t < threads; ++t)
    L.fibers[t].tid =
        uint3{t % block.x, (t / block.x) % block.y, static_cast<unsigned>(t / (uint64_t{block.x} * block.y))};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = uint3{x, y, z};
        // Unwritten doubles and floats read as NaN; 256 guard bytes after the end catch a write past it.
        L.dynamic_shared.assign(shared_bytes + kSharedGuard, 0xff);
        std::memset(L.dynamic_shared.data() + shared_bytes, 0xa5, kSharedGuard);
        run_block(static_cast<unsigned>(threads));
        for (size_t i = shared_bytes; i < shared_bytes + kSharedGuard; ++i)
          if (L.dynamic_shared[i] != 0xa5) fail("a write past the end of the dynamic shared memory");
        ++L.blocks;
      }
  L.body = nullptr;
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(g_launch.dynamic_shared.data());
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof v);
  return u;
}
template <typename T>
T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

template <typename T>
T shfl_xor(unsigned mask, T v, int arg, int line) {
  if (mask != 0xffffffffu) fail("a warp shuffle with a partial mask (not emulated)", line);
  return from_bits<T>(shuffle(to_bits(v), arg, line));
}

}  // namespace simt

#define __syncthreads() ::simt::syncthreads(__LINE__)
// The only shuffle the kernels use; another intrinsic is a compile error here, to be added when used.
#define __shfl_xor_sync(mask, v, o) ::simt::shfl_xor((mask), (v), (o), __LINE__)

// Device intrinsics the math headers use under __CUDA_ARCH__, with their device semantics.
inline unsigned int __float_as_uint(float f) { return simt::to_bits(f) & 0xffffffffu; }
inline float __uint_as_float(unsigned int u) { return simt::from_bits<float>(u); }
inline double __longlong_as_double(long long v) { return simt::from_bits<double>(static_cast<uint64_t>(v)); }
// The fast division: within 2 ulp on the device for divisors in [2^-126, 2^126] (the one use
// divides by [1, 2]); here the correctly rounded quotient, which is inside that bound.
inline float __fdividef(float a, float b) { return a / b; }
