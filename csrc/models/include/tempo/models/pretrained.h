// Hugging Face checkpoints in and out of tempo's models: safetensors files (read with every
// header field checked against the file; written in the same format), config.json mapped to a
// ModelConfig, and parameter names mapped by one declarative table per family (BERT, RoBERTa,
// GPT-2, LLaMA), including the fused q/k/v projection and GPT-2's transposed Conv1D weights.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tempo/models/config.h"
#include "tempo/models/transformer.h"

namespace tempo::models {

// A safetensors file: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the bytes. Every tensor comes back on the CPU in
// its stored dtype (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL). A truncated file, a
// header that is not JSON, a byte range outside the file, overlapping ranges or one whose
// length disagrees with dtype x shape: a c10::Error naming the file and the tensor.
std::map<std::string, at::Tensor> read_safetensors(const std::string& path);
// Writes tensors (any device, contiguous or not) and string metadata, in the order given.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// config.json of a Hugging Face model (model_type bert, roberta, gpt2 or llama) as a
// ModelConfig; what this library cannot run faithfully (another activation, grouped-query
// attention, rope scaling, relative positions, ...) is refused by name.
ModelConfig config_from_json(const std::string& json_text, const std::string& name = "pretrained");

// What a load did beyond filling the backbone (which must be complete).
struct LoadReport {
  std::vector<std::string> fresh;   // our head parameters the checkpoint lacks: left initialised
  std::vector<std::string> unused;  // checkpoint tensors nothing of ours takes
  std::vector<std::string> notes;   // e.g. "lm_head.weight: tied to tokens.weight in the checkpoint; copied"
};

// A model of the folder's config.json under `policy`, its weights from model.safetensors (or
// the shards of model.safetensors.index.json), converted to float32. Every backbone parameter
// must be in the checkpoint with its shape; task heads may be absent (then fresh, reported).
// `adjust` may change what does not change a shape (dropout, eps) before the model is built.
TransformerModel load_pretrained(const std::string& dir, const MemoryPolicy& policy = MemoryPolicy::parse("eager"),
                                 LoadReport* report = nullptr,
                                 const std::function<void(ModelConfig&)>& adjust = nullptr);
// config.json and model.safetensors that transformers (and load_pretrained) read back: the
// architecture's ...ForMaskedLM / ...LMHeadModel / ...ForCausalLM names and layout.
void save_pretrained(TransformerModel& model, const std::string& dir);

}  // namespace tempo::models
