// Compiled with tempo=tempo_simt (see api.h): `tempo` below is the emulated build's namespace.
#include "api.h"

#include <map>

#include "cuda_runtime.h"
#include "tempo/dropout.h"

namespace simt_api {
namespace {
std::map<std::string, Entry>& entries() {  // filled while the translated sources initialise
  static std::map<std::string, Entry> table;
  return table;
}
}  // namespace

bool register_entry(const char* name, Entry fn) { return entries().emplace(name, fn).second; }

std::string call(const std::string& entry, const void* params) {
  const auto it = entries().find(entry);
  if (it == entries().end()) return "simt_api: no emulated entry point named " + entry;
  return it->second(params);
}

std::string philox_state_store(const void* state, uint64_t* out) {
  const tempo::Status s = tempo::philox_state_store_cuda(*static_cast<const tempo::PhiloxState*>(state), out, nullptr);
  return s.ok() ? std::string() : s.message();
}

Counters counters() { return {simt::g_launch.blocks, simt::g_launch.barriers, simt::g_launch.shuffles}; }

}  // namespace simt_api
