// Training checkpoints: a directory per step (model.safetensors, optimizer.pt, state.safetensors
// with the step and the random generators' states, and a MANIFEST with each file's size and
// CRC-32; manifest.h), written under a temporary name, synced and renamed into place, so a crash leaves
// either the whole checkpoint or none. Loading verifies the manifest; a damaged newest
// checkpoint is reported and the previous good one used.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tempo::train {

// Writes DIR/step-<step> (and removes all but the newest `keep`). Returns its path.
// `settings`: text the caller wants back at resume (the trainer's run options), kept with the
// step and checked by the manifest like the rest.
std::string save_checkpoint(const std::string& dir, int64_t step, torch::nn::Module& model,
                            torch::optim::Optimizer& optimizer, int keep = 2, const std::string& settings = "");

// The newest checkpoint under DIR that verifies, loaded into model and optimizer (and the
// generators' states restored); its step, or nullopt when there is none. Each damaged one
// skipped adds a line to `skipped`; `settings`, if given, receives what save_checkpoint kept.
std::optional<int64_t> load_latest_checkpoint(const std::string& dir, torch::nn::Module& model,
                                              torch::optim::Optimizer& optimizer, std::vector<std::string>* skipped,
                                              std::string* settings = nullptr);

}  // namespace tempo::train
