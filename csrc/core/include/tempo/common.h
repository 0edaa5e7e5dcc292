// Shared definitions of the framework-free kernel core: dtypes, the status type that core
// entry points return, and the host/device qualifier for math shared by CPU and CUDA.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#if defined(__CUDACC__)
#define TEMPO_HD __host__ __device__ __forceinline__
#else
#define TEMPO_HD inline
#endif

namespace tempo {

// Element types the kernels accept. 16-bit types are computed in fp32.
enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

const char* dtype_name(DType dtype);

// Packed 1-bit masks (the activations' bits, dropout's keep bits): bit (i % 8) of byte (i / 8)
// is element i's, least significant first. Bytes for numel elements (int64_t or c10::SymInt).
template <typename N>
TEMPO_HD N bit_mask_bytes(N numel) {
  return (numel + 7) / 8;
}

// The largest element count a core op accepts (2^59): byte counts of 8-byte elements, bit-mask
// sizes and the kernels' index arithmetic then stay within int64.
constexpr int64_t kMaxNumel = int64_t{1} << 59;

// Whether non-negative sizes multiply to at most kMaxNumel, zeros left out: so that every
// partial product a kernel or a validation forms (batch * seq before a zero head_dim) fits too.
inline bool numel_fits(std::initializer_list<int64_t> sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    if (s < 0) return false;
    if (s == 0) continue;
    if (s > kMaxNumel / n) return false;
    n *= s;
  }
  return true;
}

// Result of a core entry point: ok, or an error with a message for the caller to raise.
// The core never throws.
class Status {
 public:
  static Status Ok() { return Status(); }
  static Status Error(std::string message) { return Status(std::move(message)); }
  bool ok() const { return ok_; }
  const std::string& message() const { return message_; }

 private:
  Status() = default;
  explicit Status(std::string message) : ok_(false), message_(std::move(message)) {}
  bool ok_ = true;
  std::string message_;
};

// What the core was built with (for `tempo env`).
struct BuildInfo {
  const char* version;
  bool cuda_compiled;  // CUDA kernels linked into this build
  bool openmp;         // CPU kernels parallelised with OpenMP
  int max_threads;     // OpenMP threads available (1 without OpenMP)
};
BuildInfo build_info();

// Whether `stream` (a cudaStream_t) is being captured into a CUDA graph, where the host can
// neither draw a seed the replays would share nor read device memory; false in a build
// without CUDA kernels.
bool cuda_stream_capturing(void* stream);

}  // namespace tempo

// In a build without CUDA (TEMPO_WITH_CUDA=0, set by the build for the core's sources) an
// op's CUDA entry point still exists and says why it cannot run; each op's core .cpp
// declares its own, beside its validation:
//   TEMPO_CUDA_UNAVAILABLE(norm_forward_cuda, NormForwardParams, "norm forward")
#if defined(TEMPO_WITH_CUDA) && !TEMPO_WITH_CUDA
#define TEMPO_CUDA_UNAVAILABLE(fn, Params, what)                                           \
  Status fn(const Params&, void*) {                                                        \
    return Status::Error(std::string(what) + ": this build of tempo has no CUDA kernels"); \
  }
#else
#define TEMPO_CUDA_UNAVAILABLE(fn, Params, what)
#endif

// Validation inside the core: return an error Status instead of asserting.
#define TEMPO_CORE_CHECK(cond, msg)                               \
  do {                                                            \
    if (!(cond)) return ::tempo::Status::Error(std::string(msg)); \
  } while (0)
