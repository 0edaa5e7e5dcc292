// Hugging Face checkpoints in and out of tempo's models: the folder's files read and written by
// hf_files.h, and parameter names mapped by one declarative table per family (BERT, RoBERTa,
// GPT-2, LLaMA), including the fused q/k/v projection and GPT-2's transposed Conv1D weights.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tempo/models/config.h"
#include "tempo/models/hf_files.h"
#include "tempo/models/transformer.h"

namespace tempo::models {

// What a load did beyond filling the backbone (which must be complete).
struct LoadReport {
  std::vector<std::string> fresh;   // our head parameters the checkpoint lacks: left initialised
  std::vector<std::string> unused;  // checkpoint tensors nothing of ours takes
  std::vector<std::string> notes;   // e.g. "lm_head.weight: tied to tokens.weight in the checkpoint; copied"
};

// The folder's config.json as a ModelConfig (what load_pretrained builds), without reading
// the weights: a missing or damaged file, or a model this library cannot run, is a c10::Error.
ModelConfig pretrained_config(const std::string& dir);
// A model of the folder's config.json under `method`, its weights from model.safetensors (or
// the shards of model.safetensors.index.json), converted to float32. Every backbone parameter
// must be in the checkpoint with its shape; task heads may be absent (then fresh, reported).
// `adjust` may change what does not change a shape (dropout, eps) before the model is built.
TransformerModel load_pretrained(const std::string& dir, const Method& method = Method::parse("eager"),
                                 LoadReport* report = nullptr,
                                 const std::function<void(ModelConfig&)>& adjust = nullptr);
// config.json and model.safetensors that transformers (and load_pretrained) read back: the
// architecture's ...ForMaskedLM / ...LMHeadModel / ...ForCausalLM names and layout.
void save_pretrained(TransformerModel& model, const std::string& dir);

}  // namespace tempo::models
