// A checkpoint's MANIFEST: one line per file, "<name> <bytes> <CRC-32 as 8 hex digits>\n".
// Loading trusts a checkpoint only when its MANIFEST parses, lists exactly the files the
// checkpoint must hold (each once, so no name can point outside its directory), and every file
// has the listed size and checksum. Framework-free (fuzzed in tests/fuzz/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tempo::train {

struct ManifestEntry {
  std::string name;
  uint64_t bytes = 0;
  uint32_t crc = 0;
};

// CRC-32 (IEEE 802.3) of `n` bytes, continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);
// CRC-32 of a file's bytes; throws std::runtime_error when it cannot be read.
uint32_t file_crc32(const std::string& path);

// The MANIFEST text for these files of `dir` (their sizes and checksums now).
std::string make_manifest(const std::string& dir, const std::vector<std::string>& files);

// Parses MANIFEST text into `out`; returns why it is refused, or "" when it lists each of
// `expected` exactly once and nothing else, in well-formed lines.
std::string parse_manifest(const std::string& text, const std::vector<std::string>& expected,
                           std::vector<ManifestEntry>* out);

// "" when dir/MANIFEST parses (as above) and every file it lists has its size and checksum;
// else why not.
std::string verify_manifest(const std::string& dir, const std::vector<std::string>& expected);

}  // namespace tempo::train
