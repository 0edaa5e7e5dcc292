// libFuzzer target: tempo::models::config_from_json on arbitrary text. Property: a ModelConfig
// that passes its own validate(), or c10::Error naming the loader; never a crash, undefined
// behaviour (a number out of range for its field), or another exception type.
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tempo/models/hf_files.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const tempo::models::ModelConfig c = tempo::models::config_from_json(text, "fuzz");
    c.validate();  // accepted: must be a config the models can build
    if (c.hidden % c.heads != 0) std::abort();
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("tempo::models") == std::string::npos) {
      std::fprintf(stderr, "refusal without the loader's name: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
