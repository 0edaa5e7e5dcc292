// `tempo bench`: memory, maximum batch and throughput of a model per method.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "report.h"
#include "tempo/memory.h"
#include "tempo/models/config.h"

namespace tempo::tools {

struct BenchOptions {
  std::string model = "bert-base";  // a preset, or "custom" with the sizes below
  std::string arch = "bert";        // custom: bert | roberta | gpt2 | llama
  int64_t hidden = 0, layers = 0, heads = 0, intermediate = 0, vocab = 0, positions = 0;  // 0: the preset's
  int64_t seq = 128, batch = 8;
  std::vector<std::string> methods{"eager", "eager+ckpt", "sdpa", "tempo", "tempo-sdpa"};
  std::string dtype = "fp32", device = "cpu";
  std::optional<int64_t> budget;  // bytes
  int steps = 9;                  // interleaved timing rounds: one step of each method a round
  bool json = false;
  std::string csv, plot;
  bool ablation = false;
  std::vector<int64_t> ablation_seqs{128, 256, 512};
  bool data_movement = false;  // the per-operator byte account of one layer, per method
};

// One method's measurements (the fields of --json).
struct BenchResult {
  std::string model, dtype, device, method;
  int64_t seq = 0, batch = 0;
  int64_t activation_bytes = 0;  // held after the forward, beyond what was held before it
  int64_t peak_bytes = 0;        // the step's peak, everything held (weights, optimizer, ...)
  // Peaks above what was held before the step (weights, optimizer state): during forward +
  // backward (activations, gradients: where the methods differ), and during the optimizer
  // step (gradients and the optimizer's temporaries: the same for every method).
  int64_t train_peak_bytes = 0;
  int64_t optimizer_peak_bytes = 0;
  // Time from interleaved rounds (bench.cpp's time_interleaved): the median step, and the median
  // over the rounds of the baseline's step time over this method's (eager's, else the first
  // method's) with its spread, half the interquartile range over the median.
  int rounds = 0;
  double step_ms = 0, tokens_per_s = 0;
  double speedup = 0, speedup_spread = 0;
  std::optional<int64_t> max_batch;
  double max_batch_tokens_per_s = 0;  // at max_batch, the median of the rounds
  double max_batch_spread = 0;        // the spread of those steps' times
  // tokens/s at max_batch over the baseline's at its own, round by round: median and spread
  double max_batch_speedup = 0, max_batch_speedup_spread = 0;
  int64_t layer_bytes_moved = 0;  // one layer's forward + backward at --batch, per sequence (data_movement.cpp)
};

// Parses `tempo bench` arguments; throws std::invalid_argument with a clear message.
BenchOptions parse_bench_args(const std::vector<std::string>& args);
// "11GiB", "512MiB", "16GB", "1000000" -> bytes; errors begin with `tool` ("tempo bench").
int64_t parse_bytes(const std::string& text, const std::string& tool = "tempo bench");
int run_bench(const BenchOptions& options);

// The data-movement account (data_movement.cpp): every operator of one transformer layer's
// forward and backward (batch 1, the bench's sequence length, dtype and device) under a
// method, with the bytes it reads and writes (tempo::memory::TrafficScope).
std::vector<memory::OpTraffic> layer_traffic(const BenchOptions& o, const models::ModelConfig& c,
                                             const std::string& method);
int64_t traffic_total(const std::vector<memory::OpTraffic>& ops, const std::string& phase = "");
// Prints each method's account and the totals side by side (tempo bench --data-movement).
void print_data_movement(const BenchOptions& o, const models::ModelConfig& c);
void print_bench_usage(FILE* out);

// Output of the results (report.cpp).
void print_table(const std::vector<BenchResult>& results, bool budget);
void print_json(const std::vector<BenchResult>& results);
void append_csv(const std::string& path, const std::vector<BenchResult>& results);
void write_svg(const std::string& path, const std::vector<BenchResult>& results, const std::string& title);

}  // namespace tempo::tools
