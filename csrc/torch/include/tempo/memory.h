// Exact memory accounting: bytes held now and the peak, on CPU through a counting allocator
// installed in front of PyTorch's CPU allocator, on CUDA from the caching allocator's
// statistics (allocated bytes). CPU figures count the bytes tensors request, so a known
// allocation is counted exactly.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

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
// A budget on `device`: the CPU's is set_cpu_limit; on CUDA the caching allocator's
// per-process fraction of the device's memory (as torch.cuda.set_per_process_memory_fraction),
// past which an allocation raises c10::OutOfMemoryError. The CUDA limit counts the memory the
// allocator reserves (its cache included), not only the bytes tensors hold. 0 removes it. A
// build without tempo's CUDA kernels cannot set one on CUDA (an error naming the device).
void set_limit(const c10::Device& device, int64_t bytes);

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

// Bytes this process can still allocate on the host: /proc/meminfo's MemAvailable, capped by
// its cgroup's limit less its usage; nullopt where neither can be read. Past it Linux does not
// refuse an allocation but kills the process (SIGKILL), which no exception can report.
std::optional<int64_t> host_available();
// A clear error (c10::Error naming `what` and both sizes) when `bytes`, an allocation that is
// certain to come (a model's parameters, its optimizer state), exceed host_available().
void check_host_fits(int64_t bytes, const std::string& what);

// While tempo.plan counts a training step on the meta device (memory_plan_start), the device it
// plans for: kernels that decide by the device (what a CUDA kernel keeps or works in) decide
// for it on meta tensors. kNone outside a plan.
enum class PlannedDevice { kNone, kCpu, kCuda };
PlannedDevice planned_device();
// The counting CPU allocator's allocations and frees (bytes < 0), keyed by address: a trace opened
// with cpu=true records them beside the meta device's (to set a real CPU run beside its plan).
void plan_note_cpu(const void* data, int64_t bytes);
// Matmul FLOPs a kernel ran without dispatching them (on meta tensors, in tempo.plan's count), and
// those counted so far under the current tag.
void plan_note_flops(double flops);
double plan_flops_now();

// bytes -> "512 B", "2.83 MiB", "11.00 GiB": the largest binary unit that keeps the value >= 1.
std::string format_bytes(int64_t bytes);

}  // namespace tempo::memory

#include <memory>
#include <string>
#include <vector>

namespace tempo::memory {

// Data movement of the operators run in a scope: for every kernel-level operator call (ATen or
// tempo, in the forward and in autograd's backward), the bytes of its tensor operands (read)
// and of its tensor results (written), from their shapes and dtypes: what the operator moves
// if it reads each operand and writes each result once, as a memory-bound kernel does. A
// composite (linear, layer_norm, ...) is counted as the calls it makes; a call counts itself
// when none of its sub-calls moved data (they only allocate or make views). Views (results that
// alias an operand, not in place) move nothing; an operand seen twice in one call counts once;
// a broadcast operand counts its distinct elements.
struct OpTraffic {
  std::string phase;  // the label set when the op ran
  std::string op;     // "aten::addmm", "tempo::gelu", ...
  int64_t calls = 0, read = 0, written = 0;
};

// A pass an operator's kernel makes outside the dispatcher (tempo's core kernels, called
// directly): recorded as its own row under `kernel` (a no-op when no scope is open).
void note_traffic(const char* kernel, int64_t read, int64_t written);

class TrafficScope {
 public:
  // Counts on this thread (and in the threads its autograd backward runs on) until destroyed.
  // One scope at a time.
  explicit TrafficScope(std::string phase = "forward");
  ~TrafficScope();
  TrafficScope(const TrafficScope&) = delete;
  TrafficScope& operator=(const TrafficScope&) = delete;
  void set_phase(std::string phase);   // the label of the ops that follow
  std::vector<OpTraffic> ops() const;  // by (phase, op), in the order first seen
  int64_t total() const;               // read + written over every op

  struct State;

 private:
  std::shared_ptr<State> state_;
  uint64_t handle_ = 0;
};

}  // namespace tempo::memory
