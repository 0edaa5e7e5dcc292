// `tempo bench`: for each method, full training steps (forward, backward, AdamW) of a
// model: activation bytes held after the forward, the step's peak, step time and tokens/s;
// with --budget, the largest batch whose step fits (predicted from the peaks at batch 1 and
// 2, then verified by running a step at the candidate under the tracker); --ablation: the
// per-layer saving of each technique across sequence lengths.
#include "bench.h"

#include "args.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <stdexcept>

#include <unistd.h>

#include "tempo/memory.h"
#include "tempo/models/transformer.h"
#include "tempo/train/adamw.h"

namespace tempo::tools {

using memory::format_bytes;
using models::Method;
using models::ModelConfig;

void print_bench_usage(FILE* out) {
  std::fprintf(out,
               "usage: tempo bench [--model PRESET|custom] [--seq S] [--batch B] [--methods eager,eager+ckpt,...]\n"
               "                   [--dtype fp32|bf16] [--device cpu|cuda] [--budget 11GiB] [--steps N]\n"
               "                   [--json] [--csv FILE] [--plot FILE.svg] [--ablation [--ablation-seqs 128,512]]\n"
               "                   [--data-movement]\n"
               "                   custom sizes: --arch bert|roberta|gpt2|llama --hidden H --layers L --heads A\n"
               "                                 --intermediate I --vocab V --positions P (also override a preset's)\n"
               "--seq may not exceed the model's positions (bert-base: 512); --positions gives it more\n"
               "(new position embeddings: for memory and speed figures, not for a pretrained model)\n"
               "presets: bert-base bert-large roberta-base roberta-large gpt2 gpt2-medium gpt2-large llama-small\n"
               "methods: eager sdpa tempo tempo-sdpa tempo-fused, each optionally with +c/-c changes (c in gelu norm\n"
               "         dropout attention sdpa fused ckpt head kernels recompute-attention recompute-up\n"
               "         recompute-gate_up), e.g. eager+ckpt, eager+gelu\n");
}

int64_t parse_bytes(const std::string& text, const std::string& tool) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (...) {
    throw std::invalid_argument(tool + ": cannot read a size from '" + text + "' (e.g. 11GiB, 512MiB)");
  }
  const std::string unit = text.substr(pos);
  double mult = 1;
  if (unit == "" || unit == "B")
    mult = 1;
  else if (unit == "KiB")
    mult = 1024.0;
  else if (unit == "MiB")
    mult = 1024.0 * 1024;
  else if (unit == "GiB")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "KB")
    mult = 1e3;
  else if (unit == "MB")
    mult = 1e6;
  else if (unit == "GB")
    mult = 1e9;
  else
    throw std::invalid_argument(tool + ": unknown size unit '" + unit + "' in '" + text +
                                "' (B, KiB, MiB, GiB, KB, MB, GB)");
  // stod also reads "inf", "nan" and hexadecimal: none is a size (inf became -8 EiB).
  if (text.substr(0, pos).find_first_of("xXnN") != std::string::npos || !(v > 0) || !(v * mult < 0x1p62))
    throw std::invalid_argument(tool + ": a size must be a positive number below 4 EiB, got '" + text + "'");
  return static_cast<int64_t>(v * mult);
}

namespace {

std::vector<std::string> split(const std::string& s) { return split_list(s); }
int64_t positive(const std::string& flag, const std::string& v) { return parse_int("tempo bench", flag, v); }

}  // namespace

BenchOptions parse_bench_args(const std::vector<std::string>& args) {
  BenchOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string k = current_flag("tempo bench", args[i]);
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument("tempo bench: " + k + " needs a value");
      return args[++i];
    };
    if (k == "--model")
      o.model = value();
    else if (k == "--arch")
      o.arch = value();
    else if (k == "--hidden")
      o.hidden = positive(k, value());
    else if (k == "--layers")
      o.layers = positive(k, value());
    else if (k == "--heads")
      o.heads = positive(k, value());
    else if (k == "--intermediate")
      o.intermediate = positive(k, value());
    else if (k == "--vocab")
      o.vocab = positive(k, value());
    else if (k == "--positions")
      o.positions = positive(k, value());
    else if (k == "--seq")
      o.seq = positive(k, value());
    else if (k == "--batch")
      o.batch = positive(k, value());
    else if (k == "--methods")
      o.methods = split(value());
    else if (k == "--dtype")
      o.dtype = value();
    else if (k == "--device")
      o.device = value();
    else if (k == "--budget")
      o.budget = parse_bytes(value());
    else if (k == "--steps")
      o.steps = static_cast<int>(positive(k, value()));
    else if (k == "--json")
      o.json = true;
    else if (k == "--csv")
      o.csv = value();
    else if (k == "--plot")
      o.plot = value();
    else if (k == "--ablation")
      o.ablation = true;
    else if (k == "--data-movement")
      o.data_movement = true;
    else if (k == "--ablation-seqs") {
      o.ablation_seqs.clear();
      for (const auto& s : split(value())) o.ablation_seqs.push_back(positive(k, s));
    } else {
      throw std::invalid_argument("tempo bench: unknown argument '" + k + "'");
    }
  }
  if (o.seq < 2) throw std::invalid_argument("tempo bench: --seq must be at least 2");
  if (o.dtype != "fp32" && o.dtype != "bf16")
    throw std::invalid_argument("tempo bench: --dtype must be fp32 or bf16, got '" + o.dtype + "'");
  if (o.device != "cpu" && o.device != "cuda")
    throw std::invalid_argument("tempo bench: --device must be cpu or cuda, got '" + o.device + "'");
  if (o.methods.empty()) throw std::invalid_argument("tempo bench: --methods is empty");
  for (const auto& p : o.methods) {
    try {
      Method::parse(p);
    } catch (const c10::Error& e) {
      throw std::invalid_argument(e.what_without_backtrace());
    }
  }
  if (!o.plot.empty()) check_output("tempo bench", "--plot", o.plot, /*svg=*/true);
  if (!o.csv.empty()) check_output("tempo bench", "--csv", o.csv);
  return o;
}

namespace {

ModelConfig config_of(const BenchOptions& o) {
  ModelConfig c;
  if (o.model == "custom") {
    c = ModelConfig::for_arch(models::parse_arch(o.arch));
  } else {
    c = ModelConfig::preset(o.model);
  }
  c.resize(o.hidden, o.layers, o.heads, o.intermediate, o.positions, o.vocab);
  if (o.hidden || o.layers || o.heads || o.intermediate || o.vocab || o.positions) {
    std::string suffix;
    if (o.layers) suffix += "-L" + std::to_string(o.layers);
    if (o.hidden) suffix += "-H" + std::to_string(o.hidden);
    if (o.vocab) suffix += "-V" + std::to_string(o.vocab);
    if (o.positions) suffix += "-P" + std::to_string(o.positions);
    c.name += suffix.empty() ? "-custom" : suffix;
  }
  c.validate();
  if (o.device == "cpu") {  // parameters, gradients, AdamW's two moments: refused with the sizes, not killed later
    try {
      memory::check_host_fits(4 * c.parameter_count() * (o.dtype == "bf16" ? 2 : 4),
                              "tempo bench: training " + c.name + " (" + std::to_string(c.parameter_count()) +
                                  " parameters, with their gradients and AdamW's two moments)");
    } catch (const c10::Error& e) {
      throw std::invalid_argument(e.what_without_backtrace());
    }
  }
  const std::vector<int64_t> seqs = o.ablation ? o.ablation_seqs : std::vector<int64_t>{o.seq};
  for (int64_t S : seqs) {
    // RoBERTa's positions start after the padding index.
    const int64_t needed = S + (c.arch == models::Arch::kRoberta ? c.pad_id + 1 : 0);
    if (c.arch != models::Arch::kLlama && needed > c.max_positions)
      throw std::invalid_argument("tempo bench: sequence length " + std::to_string(S) + " exceeds " + c.name + "'s " +
                                  std::to_string(c.max_positions) + " positions" +
                                  (needed > S ? " (RoBERTa uses " + std::to_string(needed) + ")" : "") +
                                  "; use a shorter --seq or --positions " + std::to_string(needed));
  }
  return c;
}

struct StepStats {
  int64_t activation = 0, peak = 0;
  // Peaks above what was held before the step: forward + backward; the optimizer step.
  int64_t train_peak = 0, optimizer_peak = 0;
  double ms = 0;
};

class Runner {
 public:
  Runner(const BenchOptions& o, const ModelConfig& c, const std::string& method)
      : o_(o), c_(c), device_(o.device == "cuda" ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU)) {
    torch::manual_seed(0);
    model_ = models::make_model(c, Method::parse(method));
    model_->to(device_, o.dtype == "bf16" ? at::kBFloat16 : at::kFloat);
    model_->train();
    opt_ =
        std::make_unique<tempo::train::AdamW>(model_->parameters(), torch::optim::AdamWOptions(1e-4));  // tempo train's
  }
  void sync() const {
    if (device_.is_cuda()) torch::cuda::synchronize();
  }
  StepStats step(int64_t batch, uint64_t seed) {
    const models::Batch b = models::synthetic_batch(c_, batch, o_.seq, seed, device_);
    opt_->zero_grad(/*set_to_none=*/true);
    sync();
    StepStats s;
    const int64_t base = tempo::memory::stats(device_).current;  // weights, optimizer state
    tempo::memory::Scope scope(device_);
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor loss = model_->loss(b);
    sync();
    s.activation = scope.held();
    loss.backward();
    sync();
    s.train_peak = scope.peak();
    const int64_t train_abs = tempo::memory::stats(device_).peak;
    tempo::memory::reset_peak(device_);
    opt_->step();
    sync();
    s.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const int64_t opt_abs = tempo::memory::stats(device_).peak;
    s.optimizer_peak = opt_abs - base;
    s.peak = std::max(train_abs, opt_abs);
    if (!std::isfinite(loss.item<double>())) throw std::runtime_error("tempo bench: the loss is not finite");
    return s;
  }

 private:
  const BenchOptions& o_;
  ModelConfig c_;
  c10::Device device_;
  models::TransformerModel model_{nullptr};
  std::unique_ptr<tempo::train::AdamW> opt_;
};

// A progress line on stderr, rewritten in place on a terminal.
void progress(const BenchOptions& o, const std::string& text) {
  (void)o;
  if (!isatty(2)) return;
  std::fprintf(stderr, "\r\033[K%s", text.c_str());
  std::fflush(stderr);
}

BenchResult bench_method(const BenchOptions& o, const ModelConfig& c, const std::string& method, size_t index,
                         size_t count) {
  const std::string tag = "[" + std::to_string(index + 1) + "/" + std::to_string(count) + "] " + method + ": ";
  progress(o, tag + "building the model");
  Runner run(o, c, method);
  BenchResult r;
  r.model = c.name;
  r.dtype = o.dtype;
  r.device = o.device;
  r.method = method;
  r.seq = o.seq;
  r.batch = o.batch;
  progress(o, tag + "data movement of one layer");
  r.layer_bytes_moved = traffic_total(layer_traffic(o, c, method)) / o.batch;  // per sequence of the batch
  progress(o, tag + "warm-up step");
  run.step(o.batch, 1);
  // Memory is a function of the shapes: one step gives it exactly. Time comes from the
  // interleaved rounds (time_interleaved).
  progress(o, tag + "measured step at batch " + std::to_string(o.batch));
  const StepStats st = run.step(o.batch, 2);
  r.activation_bytes = st.activation;
  r.peak_bytes = st.peak;
  r.train_peak_bytes = st.train_peak;
  r.optimizer_peak_bytes = st.optimizer_peak;
  if (o.budget) {
    const int64_t budget = *o.budget;
    progress(o, tag + "budget search: batch 1");
    const StepStats p1 = run.step(1, 100);
    if (p1.peak > budget)
      throw std::runtime_error("tempo bench: the budget (" + format_bytes(budget) +
                               ") is too small for batch 1 under method '" + method + "': a step needs " +
                               format_bytes(p1.peak) + " (" + std::to_string(p1.peak) + " bytes)");
    progress(o, tag + "budget search: batch 2");
    const StepStats p2 = run.step(2, 101);
    // Each candidate comes from a linear model of the step's peak in the batch (its slope
    // from the measured steps, at least the activation growth per sequence) and is verified
    // by running a step at it; the largest batch seen to fit wins.
    int64_t lo = 1, hi = -1;
    StepStats at_lo = p1;
    if (p2.peak <= budget) {
      lo = 2;
      at_lo = p2;
    } else {
      hi = 2;
    }
    double slope = std::max<double>(
        {static_cast<double>(p2.activation - p1.activation), static_cast<double>(p2.peak - p1.peak), 1.0});
    // Once a batch has failed, no candidate lies beyond the middle of what is still open (a
    // bisection when the prediction overshoots); at least lo + 1 is tried, so the search
    // ends on a batch that fits next to one that does not (python/tempo/_measure.py alike).
    for (int iter = 0; iter < 16 && (hi < 0 || hi - lo > 1); ++iter) {
      int64_t cand = lo + std::max<int64_t>(1, static_cast<int64_t>(std::floor((budget - at_lo.peak) / slope)));
      if (hi > 0) cand = std::min(cand, (lo + hi) / 2);
      progress(o, tag + "budget search: verifying batch " + std::to_string(cand));
      const StepStats at = run.step(cand, 102 + iter);
      slope = std::max(static_cast<double>(at.peak - p1.peak) / static_cast<double>(cand - 1), 1.0);
      if (at.peak <= budget) {
        lo = cand;
        at_lo = at;
      } else {
        hi = cand;
      }
    }
    r.max_batch = lo;
  }
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Half the interquartile range of v over its median: the spread printed beside a ratio.
double relative_spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const double q1 = v[(v.size() - 1) / 4], q3 = v[(3 * (v.size() - 1) + 3) / 4];
  return (q3 - q1) / 2 / median(v);
}

// Step time and tokens/s of every method from interleaved rounds: each round runs one step of
// each method back to back (in an order rotated round by round), so a slow spell of the machine
// falls on all of them; each method's ratio to the baseline (eager, else the first method) is
// the median over the rounds of the two steps' ratio in that round, with its spread (half the
// interquartile range). The same at each method's largest batch with --budget. Every model is
// alive at once; where they would not fit in host memory together, each method is timed alone,
// one after the other (said on stderr).
void time_interleaved(const BenchOptions& o, const ModelConfig& c, std::vector<BenchResult>& results) {
  const size_t P = results.size(), base = [&] {
    for (size_t i = 0; i < P; ++i)
      if (results[i].method == "eager") return i;
    return size_t{0};
  }();
  bool together = true;
  if (o.device == "cpu") {
    try {
      memory::check_host_fits(static_cast<int64_t>(P) * 4 * c.parameter_count() * (o.dtype == "bf16" ? 2 : 4),
                              "tempo bench: the " + std::to_string(P) + " methods' models at once");
    } catch (const c10::Error&) {
      together = false;
      std::fprintf(stderr, "tempo bench: the %zu models do not fit in host memory together: timed one at a time\n", P);
    }
  }
  const int rounds = o.steps;
  std::vector<std::vector<double>> ms(P), at_max(P);
  auto time_method = [&](Runner& run, size_t k, int round) {
    progress(o, "timing: round " + std::to_string(round + 1) + "/" + std::to_string(rounds) + ", " + results[k].method);
    ms[k].push_back(run.step(o.batch, 1000 + round).ms);
    if (results[k].max_batch) at_max[k].push_back(run.step(*results[k].max_batch, 2000 + round).ms);
  };
  auto warm = [&](Runner& run, size_t k) {
    run.step(o.batch, 3);
    if (results[k].max_batch) run.step(*results[k].max_batch, 4);
  };
  if (together) {
    std::vector<std::unique_ptr<Runner>> runs;
    for (size_t k = 0; k < P; ++k) {
      progress(o, "timing: building " + results[k].method);
      runs.push_back(std::make_unique<Runner>(o, c, results[k].method));
      warm(*runs.back(), k);
    }
    for (int round = 0; round < rounds; ++round)
      for (size_t j = 0; j < P; ++j) {
        const size_t k = (j + static_cast<size_t>(round)) % P;
        time_method(*runs[k], k, round);
      }
  } else {
    for (size_t k = 0; k < P; ++k) {
      Runner run(o, c, results[k].method);
      warm(run, k);
      for (int round = 0; round < rounds; ++round) time_method(run, k, round);
    }
  }
  for (size_t k = 0; k < P; ++k) {
    BenchResult& r = results[k];
    r.rounds = rounds;
    r.step_ms = median(ms[k]);
    r.tokens_per_s = static_cast<double>(o.batch * o.seq) / (r.step_ms / 1000.0);
    std::vector<double> ratio(rounds);
    for (int i = 0; i < rounds; ++i) ratio[i] = ms[base][i] / ms[k][i];
    r.speedup = median(ratio);
    r.speedup_spread = relative_spread(ratio);
    if (r.max_batch) {
      r.max_batch_tokens_per_s = static_cast<double>(*r.max_batch * o.seq) / (median(at_max[k]) / 1000.0);
      r.max_batch_spread = relative_spread(at_max[k]);
      if (results[base].max_batch) {  // tokens/s over the baseline's at its own largest batch, round by round
        for (int i = 0; i < rounds; ++i)
          ratio[i] = (static_cast<double>(*r.max_batch) / at_max[k][i]) /
                     (static_cast<double>(*results[base].max_batch) / at_max[base][i]);
        r.max_batch_speedup = median(ratio);
        r.max_batch_speedup_spread = relative_spread(ratio);
      }
    }
  }
}

// Per-layer activation bytes (forward of 2 layers minus 1, batch 1) of each technique.
int run_ablation(const BenchOptions& o, const ModelConfig& base) {
  const std::vector<std::pair<std::string, std::string>> rows = {
      {"eager", "baseline"},
      {"eager+gelu", "in-place GELU"},
      {"eager+norm", "in-place LayerNorm"},
      {"eager+dropout", "bit-packed dropout masks"},
      {"eager+attention", "dropout recomputation + output-only softmax"},
      {"tempo", "all of tempo"},
      {"tempo-sdpa", "tempo + fused attention"},
  };
  const c10::Device device = o.device == "cuda" ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  std::vector<std::vector<int64_t>> bytes(rows.size());
  for (size_t s = 0; s < o.ablation_seqs.size(); ++s) {
    const int64_t S = o.ablation_seqs[s];
    for (size_t k = 0; k < rows.size(); ++k) {
      progress(o, "ablation: seq " + std::to_string(S) + ", " + rows[k].first);
      int64_t held[2];
      for (int layers = 1; layers <= 2; ++layers) {
        ModelConfig c = base;
        c.layers = layers;
        torch::manual_seed(0);
        auto m = models::make_model(c, Method::parse(rows[k].first));
        m->to(device, o.dtype == "bf16" ? at::kBFloat16 : at::kFloat);
        m->train();
        const at::Tensor ids = at::randint(2, c.vocab, {1, S}, at::TensorOptions().dtype(at::kLong).device(device));
        tempo::memory::Scope scope(device);
        at::Tensor h = m->hidden_states(ids, at::Tensor());
        held[layers - 1] = scope.held();
      }
      bytes[k].push_back(held[1] - held[0]);
    }
  }
  progress(o, "");
  std::printf("per-layer activation bytes of %s (batch 1, %s, %s), and the reduction against eager\n",
              base.name.c_str(), o.dtype.c_str(), o.device.c_str());
  std::printf("%-46s", "technique");
  for (int64_t S : o.ablation_seqs) std::printf(" %18s", ("seq " + std::to_string(S)).c_str());
  std::printf("\n");
  for (size_t k = 0; k < rows.size(); ++k) {
    std::printf("%-46s", (rows[k].first + " (" + rows[k].second + ")").substr(0, 46).c_str());
    for (size_t s = 0; s < o.ablation_seqs.size(); ++s) {
      char cell[64];
      std::snprintf(cell, sizeof cell, "%.2f MiB %5.1f%%", bytes[k][s] / 1048576.0,
                    100.0 * (1.0 - static_cast<double>(bytes[k][s]) / bytes[0][s]));
      std::printf(" %18s", cell);
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.device == "cuda" && !torch::cuda::is_available())
    throw std::invalid_argument("tempo bench: --device cuda but no CUDA device is available");
  if (o.device == "cpu") tempo::memory::track_cpu();
  ModelConfig c;
  try {
    c = config_of(o);
  } catch (const c10::Error& e) {
    throw std::invalid_argument(e.what_without_backtrace());
  }
  if (o.ablation) return run_ablation(o, c);
  if (o.data_movement) {
    print_data_movement(o, c);
    return 0;
  }
  std::vector<BenchResult> results;
  for (size_t i = 0; i < o.methods.size(); ++i)
    results.push_back(bench_method(o, c, o.methods[i], i, o.methods.size()));
  time_interleaved(o, c, results);
  progress(o, "");
  if (o.json)
    print_json(results);
  else
    print_table(results, o.budget.has_value());
  if (!o.csv.empty()) append_csv(o.csv, results);
  if (!o.plot.empty()) {
    write_svg(o.plot, results,
              "tempo bench: " + c.name + ", seq " + std::to_string(o.seq) + ", " + o.dtype + ", " + o.device);
    if (!o.json) std::printf("plot written to %s\n", o.plot.c_str());
  }
  return 0;
}

}  // namespace tempo::tools
