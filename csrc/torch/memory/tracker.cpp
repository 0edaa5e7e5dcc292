// The counting CPU allocator and the device-generic statistics behind tempo/memory.h, with
// the ops that open them to Python (tempo::memory_track, memory_stats, memory_reset_peak,
// memory_set_cpu_limit).
#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <unordered_map>
#include <utility>
#include <mutex>
#include <vector>

#include "tempo/memory.h"

#if TEMPO_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace tempo::memory {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_limit{0};  // 0: none

// The device's caching allocator, initialised first: CUDA's is set up by the lazy init that a
// first tensor on the device triggers, and asking it anything before that fails ("Allocator not
// initialized for device"; e.g. `tempo train --budget` sets the limit before any allocation).
c10::DeviceAllocator* device_allocator(const c10::Device& device) {
  at::globalContext().lazyInitDevice(device.type());
  return at::getDeviceAllocator(device.type());
}

void add(int64_t n) {
  const int64_t now = g_current.fetch_add(n) + n;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {}
}

// The allocations of the allocator it replaces, by data pointer: the DataPtr handed out has
// the data pointer as its context (a "simple" DataPtr), so raw_allocate / raw_deleter work.
struct Blocks {
  std::mutex mutex;
  std::unordered_map<void*, std::pair<c10::DataPtr, int64_t>> live;
};
Blocks& blocks() {
  static Blocks* b = new Blocks();  // never destroyed: frees may run during static destruction
  return *b;
}

void free_block(void* data) {
  c10::DataPtr inner;
  {
    Blocks& b = blocks();
    std::lock_guard<std::mutex> lock(b.mutex);
    auto it = b.live.find(data);
    if (it == b.live.end()) return;
    g_current.fetch_sub(it->second.second);
    plan_note_cpu(data, -it->second.second);
    inner = std::move(it->second.first);
    b.live.erase(it);
  }
  // `inner` frees the memory through its own deleter here.
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    const int64_t limit = g_limit.load();
    if (limit > 0 && g_current.load() + static_cast<int64_t>(n) > limit) {
      // The same error type as a CUDA out-of-memory (torch.OutOfMemoryError in Python), so a
      // search for the largest batch treats the two alike.
      TORCH_CHECK_WITH(OutOfMemoryError, false, "tempo::memory: CPU out of memory under the limit of ", limit,
                       " bytes: ", g_current.load(), " bytes held, ", n, " more requested");
    }
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    if (!data) return inner;  // zero bytes
    {
      Blocks& b = blocks();
      std::lock_guard<std::mutex> lock(b.mutex);
      b.live.emplace(data, std::make_pair(std::move(inner), static_cast<int64_t>(n)));
    }
    add(static_cast<int64_t>(n));
    plan_note_cpu(data, static_cast<int64_t>(n));
    return {data, data, &free_block, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* base_;
};

std::once_flag g_install;
std::atomic<bool> g_installed{false};

}  // namespace

void track_cpu() {
  std::call_once(g_install, [] {
    static CountingAllocator allocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
    g_installed = true;
  });
}

bool tracking_cpu() { return g_installed.load(); }

void set_cpu_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "tempo::memory: the CPU limit must be >= 0 bytes (0: none), got ", bytes);
  if (bytes > 0) track_cpu();
  g_limit.store(bytes);
}
int64_t cpu_limit() { return g_limit.load(); }

void set_limit(const c10::Device& device, int64_t bytes) {
  if (device.is_cpu()) return set_cpu_limit(bytes);
  TORCH_CHECK(bytes >= 0, "tempo::memory: the limit on ", device, " must be >= 0 bytes (0: none), got ", bytes);
#if TEMPO_TORCH_CUDA
  if (device.is_cuda()) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
    const auto total = static_cast<double>(device_allocator(device)->getMemoryInfo(index).second);
    c10::cuda::CUDACachingAllocator::setMemoryFraction(bytes == 0 ? 1.0 : std::min(1.0, bytes / total), index);
    return;
  }
#endif
  TORCH_CHECK(false, "tempo::memory: a memory limit on ", device,
              " needs tempo's CUDA build (this one has only the CPU's)");
}

Stats stats(const c10::Device& device) {
  if (device.is_cpu()) {
    TORCH_CHECK(tracking_cpu(),
                "tempo::memory: CPU bytes are counted only after track_cpu() "
                "(tempo.memory.track() in Python)");
    return {g_current.load(), g_peak.load()};
  }
  const auto s = device_allocator(device)->getDeviceStats(device.has_index() ? device.index() : 0);
  const auto& a = s.allocated_bytes[0];  // aggregate over pools
  return {a.current, a.peak};
}

void reset_peak(const c10::Device& device) {
  if (device.is_cpu()) {
    g_peak.store(g_current.load());
    return;
  }
  device_allocator(device)->resetPeakStats(device.has_index() ? device.index() : 0);
}

Scope::Scope(const c10::Device& device) : device_(device) {
  reset_peak(device_);
  start_ = stats(device_).current;
}
int64_t Scope::held() const { return stats(device_).current - start_; }
int64_t Scope::peak() const { return stats(device_).peak - start_; }

namespace {
void op_track() { track_cpu(); }
std::vector<int64_t> op_stats(c10::Device device) {
  const Stats s = stats(device);
  return {s.current, s.peak};
}
void op_reset_peak(c10::Device device) { reset_peak(device); }
void op_set_limit(int64_t bytes) { set_cpu_limit(bytes); }
int64_t op_limit() { return cpu_limit(); }
}  // namespace

}  // namespace tempo::memory

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def("memory_track() -> ()", &tempo::memory::op_track);
  m.def("memory_stats(Device device) -> int[]", &tempo::memory::op_stats);
  m.def("memory_reset_peak(Device device) -> ()", &tempo::memory::op_reset_peak);
  m.def("memory_set_cpu_limit(int bytes) -> ()", &tempo::memory::op_set_limit);
  m.def("memory_cpu_limit() -> int", &tempo::memory::op_limit);
}
