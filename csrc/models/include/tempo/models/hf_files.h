// The files of a Hugging Face model folder that tempo parses and writes: safetensors and
// config.json. Both readers refuse damaged input with a c10::Error (fuzzed in tests/fuzz/).
#pragma once

#include <ATen/core/Tensor.h>

#include <istream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tempo/models/config.h"

namespace tempo::models {

// A safetensors file: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the bytes. Every tensor comes back on the CPU in
// its stored dtype (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL). A truncated file, a
// header that is not JSON, a byte range outside the file, overlapping ranges or one whose
// length disagrees with dtype x shape: a c10::Error naming the file and the tensor.
std::map<std::string, at::Tensor> read_safetensors(const std::string& path);
// The same from a seekable stream (`path` only names it in errors).
std::map<std::string, at::Tensor> read_safetensors(std::istream& in, const std::string& path);
// Writes tensors (any device, contiguous or not) and string metadata, in the order given.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// config.json of a Hugging Face model (model_type bert, roberta, gpt2 or llama) as a
// ModelConfig; what this library cannot run faithfully (another activation, grouped-query
// attention, rope scaling, relative positions, ...) is refused by name.
ModelConfig config_from_json(const std::string& json_text, const std::string& name = "pretrained");

// Whether this build reads and writes Hugging Face files (it was built with nlohmann-json).
bool hf_files_available();

namespace detail {
// In a build without nlohmann-json: the error every Hugging Face file function raises.
[[noreturn]] void no_json();
}  // namespace detail

}  // namespace tempo::models
