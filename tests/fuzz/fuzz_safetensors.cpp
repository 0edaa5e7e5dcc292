// libFuzzer target: tempo::models::read_safetensors on arbitrary bytes. Property: it returns
// tensors whose byte sizes match their headers, or raises c10::Error with a message naming the
// reader; never a crash, an out-of-bounds read, an allocation the file cannot back, or another
// exception type. Accepted files are written back and read again to the same tensors.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <unistd.h>

#include "tempo/models/hf_files.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  std::istringstream in(bytes);
  std::map<std::string, at::Tensor> tensors;
  try {
    tensors = tempo::models::read_safetensors(in, "fuzz.safetensors");
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("read_safetensors") == std::string::npos) {
      std::fprintf(stderr, "refusal without the reader's name: %s\n", e.what());
      std::abort();
    }
    return 0;
  }
  // What was accepted fits in the file, and round-trips.
  size_t total = 0;
  for (const auto& [name, t] : tensors) total += static_cast<size_t>(t.numel()) * t.element_size();
  if (total > size) {
    std::fprintf(stderr, "accepted %zu tensor bytes from a %zu-byte file\n", total, size);
    std::abort();
  }
  static const std::string path = "/tmp/fuzz_safetensors." + std::to_string(::getpid()) + ".st";
  std::vector<std::pair<std::string, at::Tensor>> list(tensors.begin(), tensors.end());
  tempo::models::write_safetensors(path, list);
  const auto again = tempo::models::read_safetensors(path);
  std::remove(path.c_str());
  if (again.size() != tensors.size()) std::abort();
  for (const auto& [name, t] : tensors) {
    const auto& u = again.at(name);
    if (u.scalar_type() != t.scalar_type() || u.sizes() != t.sizes() ||
        (t.numel() && std::memcmp(u.data_ptr(), t.data_ptr(), t.numel() * t.element_size()) != 0)) {
      std::fprintf(stderr, "tensor '%s' changed in a write and read\n", name.c_str());
      std::abort();
    }
  }
  return 0;
}
