// What the host can still give this process, and a clear error before an allocation that
// cannot fit: on Linux an allocation past it is not refused but ends in the kernel's
// out-of-memory killer (SIGKILL), which no exception reports.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "tempo/memory.h"

namespace tempo::memory {

namespace {
// The first integer in `path` after `key` (the whole file when key is empty); nullopt when the
// file is missing or holds no number there ("max" in a cgroup file: no limit).
std::optional<int64_t> read_number(const char* path, const std::string& key = "") {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  std::string line;
  while (std::getline(f, line)) {
    if (!key.empty() && line.rfind(key, 0) != 0) continue;
    std::istringstream in(key.empty() ? line : line.substr(key.size()));
    long long v = 0;
    if (in >> v && v >= 0) return static_cast<int64_t>(v);
    return std::nullopt;
  }
  return std::nullopt;
}

void cap(std::optional<int64_t>& avail, std::optional<int64_t> limit, std::optional<int64_t> usage) {
  // cgroup v1 reports "no limit" as a huge number; anything past 2^60 is none
  if (!limit || !usage || *limit >= (int64_t{1} << 60)) return;
  const int64_t left = std::max<int64_t>(0, *limit - *usage);
  avail = avail ? std::min(*avail, left) : left;
}
}  // namespace

std::optional<int64_t> host_available() {
  std::optional<int64_t> avail;
  if (auto kb = read_number("/proc/meminfo", "MemAvailable:")) avail = *kb * 1024;
  cap(avail, read_number("/sys/fs/cgroup/memory.max"), read_number("/sys/fs/cgroup/memory.current"));
  cap(avail, read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
      read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes"));
  return avail;
}

void check_host_fits(int64_t bytes, const std::string& what) {
  const auto avail = host_available();
  TORCH_CHECK(!avail || bytes <= *avail, what, " needs ", format_bytes(bytes), " (", bytes,
              " bytes) of host memory, more than the ", format_bytes(*avail),
              " this host can still allocate (MemAvailable, within any cgroup limit); refused before allocating, "
              "since past it the kernel would kill the process");
}

std::string format_bytes(int64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (u < 5 && std::fabs(v) >= 1024.0) {
    v /= 1024.0;
    ++u;
  }
  char buf[48];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace tempo::memory
