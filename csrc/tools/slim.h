// `tempo slim`: SLiM's peak memory, step time and gradient discrepancy to full
// backpropagation for each chunk size, on a PerformerLM preset.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace tempo::tools {

struct SlimOptions {
  std::string preset = "copy";
  int64_t seq = 0;  // 0: the preset's length
  int64_t batch = 1;
  std::vector<std::optional<int64_t>> chunks{64, 128, std::nullopt};  // nullopt: full backpropagation
  std::vector<std::string> methods{"tempo"};                          // eager | tempo (GELU, LayerNorm)
  int64_t layers = 0, d_model = 0, heads = 0, ffn = 0;                // 0: the preset's
  std::string feature_map, mode;                                      // empty: the preset's
  std::string dtype = "fp32", device = "cpu";
  int repeats = 3;
  uint64_t seed = 0;
  bool json = false;
  std::string plot;
};

// One (method, chunk) measurement (the fields of --json).
struct SlimResult {
  std::string preset, method, dtype, device;
  int64_t seq = 0, batch = 0;
  std::optional<int64_t> chunk;  // nullopt: full backpropagation
  int64_t peak_bytes = 0;        // the step's peak above what was held before it (weights, gradients)
  double step_ms = 0, loss = 0, grad_rel_discrepancy = 0;
};

SlimOptions parse_slim_args(const std::vector<std::string>& args);  // std::invalid_argument on bad input
std::vector<SlimResult> measure_slim(const SlimOptions& options);
int run_slim(const SlimOptions& options);
void print_slim_usage(FILE* out);

}  // namespace tempo::tools
