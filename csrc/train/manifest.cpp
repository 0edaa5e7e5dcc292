#include "tempo/train/manifest.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace tempo::train {

namespace {
namespace fs = std::filesystem;

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }
int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto& table = crc_table();
  const auto* b = static_cast<const uint8_t*>(data);
  uint32_t c = crc ^ 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ b[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t file_crc32(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f.good()) throw std::runtime_error("tempo::train::file_crc32: cannot read " + path);
  uint32_t c = 0;
  std::vector<char> buf(1 << 20);
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    c = crc32(buf.data(), static_cast<size_t>(f.gcount()), c);
  }
  if (f.bad()) throw std::runtime_error("tempo::train::file_crc32: reading " + path + " failed");
  return c;
}

std::string make_manifest(const std::string& dir, const std::vector<std::string>& files) {
  std::string text;
  for (const auto& name : files) {
    const fs::path p = fs::path(dir) / name;
    char line[64];
    std::snprintf(line, sizeof line, " %llu %08x\n", static_cast<unsigned long long>(fs::file_size(p)),
                  file_crc32(p.string()));
    text += name + line;
  }
  return text;
}

std::string parse_manifest(const std::string& text, const std::vector<std::string>& expected,
                           std::vector<ManifestEntry>* out) {
  out->clear();
  size_t pos = 0;
  int line_no = 0;
  while (pos < text.size()) {
    ++line_no;
    const size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) return "line " + std::to_string(line_no) + " is not terminated (truncated?)";
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    const std::string where = "line " + std::to_string(line_no) + ": ";
    const size_t s1 = line.find(' ');
    const size_t s2 = s1 == std::string::npos ? s1 : line.find(' ', s1 + 1);
    if (s2 == std::string::npos || line.find(' ', s2 + 1) != std::string::npos)
      return where + "not '<name> <bytes> <crc32>'";
    ManifestEntry e;
    e.name = line.substr(0, s1);
    const std::string bytes = line.substr(s1 + 1, s2 - s1 - 1), crc = line.substr(s2 + 1);
    if (std::find(expected.begin(), expected.end(), e.name) == expected.end())
      return where + "'" + e.name + "' is not a file of a checkpoint";
    for (const auto& seen : *out)
      if (seen.name == e.name) return where + "'" + e.name + "' is listed twice";
    if (bytes.empty() || bytes.size() > 19 || !std::all_of(bytes.begin(), bytes.end(), is_digit))
      return where + "the size '" + bytes + "' is not a byte count";
    for (char c : bytes) e.bytes = e.bytes * 10 + static_cast<uint64_t>(c - '0');  // < 10^19 < 2^64
    if (crc.size() != 8) return where + "the checksum '" + crc + "' is not 8 hex digits";
    for (char c : crc) {
      const int v = hex_value(c);
      if (v < 0) return where + "the checksum '" + crc + "' is not 8 hex digits";
      e.crc = (e.crc << 4) | static_cast<uint32_t>(v);
    }
    out->push_back(std::move(e));
  }
  for (const auto& name : expected)
    if (std::none_of(out->begin(), out->end(), [&](const ManifestEntry& e) { return e.name == name; }))
      return "it does not list " + name + " (incomplete)";
  return "";
}

std::string verify_manifest(const std::string& dir, const std::vector<std::string>& expected) {
  std::ifstream mf(fs::path(dir) / "MANIFEST", std::ios::binary);
  if (!mf.good()) return "no MANIFEST";
  std::stringstream text;
  text << mf.rdbuf();
  std::vector<ManifestEntry> entries;
  const std::string why = parse_manifest(text.str(), expected, &entries);
  if (!why.empty()) return "MANIFEST " + why;
  for (const auto& e : entries) {
    const fs::path f = fs::path(dir) / e.name;
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    if (ec) return e.name + " is missing";
    if (size != e.bytes)
      return e.name + " has " + std::to_string(size) + " bytes, the manifest says " + std::to_string(e.bytes);
    try {
      if (file_crc32(f.string()) != e.crc) return e.name + " fails its checksum";
    } catch (const std::exception& ex) {
      return ex.what();
    }
  }
  return "";
}

}  // namespace tempo::train
