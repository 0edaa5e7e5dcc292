// libFuzzer target: a checkpoint's MANIFEST (tempo::train::parse_manifest and
// verify_manifest). The input is the MANIFEST of a checkpoint directory whose three files are
// real; the property: it verifies only when it lists exactly those files, each once, with
// their true sizes and checksums (so a damaged or forged manifest is refused, and no listed
// name can reach outside the directory); never a crash.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "tempo/train/manifest.h"

namespace {
namespace fs = std::filesystem;
const std::vector<std::string> kFiles = {"model.safetensors", "optimizer.pt", "state.safetensors"};

const std::string& checkpoint_dir() {
  static const std::string dir = [] {
    const fs::path d = fs::temp_directory_path() / ("fuzz_manifest." + std::to_string(::getpid()));
    fs::create_directories(d);
    int i = 0;
    for (const auto& f : kFiles) {
      std::ofstream(d / f, std::ios::binary) << std::string(static_cast<size_t>(17 * ++i), static_cast<char>('a' + i));
    }
    return d.string();
  }();
  return dir;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = checkpoint_dir();
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<tempo::train::ManifestEntry> entries;
  const std::string why = tempo::train::parse_manifest(text, kFiles, &entries);
  if (why.empty()) {
    if (entries.size() != kFiles.size()) std::abort();
  }
  { std::ofstream(fs::path(dir) / "MANIFEST", std::ios::binary) << text; }
  const std::string verdict = tempo::train::verify_manifest(dir, kFiles);
  // Accepted only if it is, entry for entry, the true manifest (in some order).
  if (verdict.empty()) {
    if (!why.empty()) std::abort();
    for (const auto& e : entries) {
      const fs::path p = fs::path(dir) / e.name;
      if (e.bytes != fs::file_size(p) || e.crc != tempo::train::file_crc32(p.string())) std::abort();
    }
  } else if (why.empty() && verdict.rfind("MANIFEST", 0) == 0) {
    std::abort();  // parsed here but refused as unparsable there
  }
  return 0;
}
