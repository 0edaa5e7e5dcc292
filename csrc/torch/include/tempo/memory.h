// Exact memory accounting: bytes held now and the peak, on CPU through a counting allocator
// installed in front of PyTorch's CPU allocator, on CUDA from the caching allocator's
// statistics (allocated bytes). CPU figures count the bytes tensors request, so a known
// allocation is counted exactly.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace tempo::memory {

// Installs the counting CPU allocator (idempotent; thread-safe). Tensors allocated before
// are not counted (their frees are not either).
void track_cpu();
bool tracking_cpu();

// A CPU budget enforced by the counting allocator: an allocation that would take the bytes it
// counts past `bytes` raises c10::OutOfMemoryError (torch.OutOfMemoryError), as a full GPU
// does. 0 removes it; a limit installs the allocator. The check and the count are separate
// atomics, so concurrent allocations may overshoot it by what they request together.
void set_cpu_limit(int64_t bytes);
int64_t cpu_limit();

struct Stats {
  int64_t current = 0;  // bytes held now
  int64_t peak = 0;     // largest `current` since the last reset
};
// CPU: needs track_cpu() (an error otherwise). CUDA: the caching allocator's allocated bytes.
Stats stats(const c10::Device& device);
void reset_peak(const c10::Device& device);

// Bytes held and the peak over a scope, relative to its start; the peak is reset on entry.
class Scope {
 public:
  explicit Scope(const c10::Device& device);
  int64_t held() const;  // current - current at entry
  int64_t peak() const;  // peak since entry - current at entry
 private:
  c10::Device device_;
  int64_t start_;
};

}  // namespace tempo::memory
