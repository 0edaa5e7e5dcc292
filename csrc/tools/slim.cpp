#include "slim.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include <unistd.h>

#include "args.h"
#include "report.h"
#include "tempo/memory.h"
#include "tempo/models/slim.h"

namespace tempo::tools {

using tempo::models::Method;
using tempo::models::PerformerConfig;
using tempo::models::PerformerLM;

void print_slim_usage(FILE* out) {
  std::fprintf(out,
               "usage: tempo slim [--preset copy|ptb|enwik8] [--seq L] [--chunks 64,128,...,full]\n"
               "                  [--methods tempo,eager] [--batch B] [--layers N] [--d-model D] [--heads A]\n"
               "                  [--ffn F] [--feature-map relu|elu|sqr|favor] [--mode iterative|prefix]\n"
               "                  [--dtype fp32|fp64] [--device cpu|cuda] [--repeats R] [--seed S]\n"
               "                  [--json] [--plot FILE.svg]\n"
               "For each method and chunk size C (full: one forward and backward over the whole sequence):\n"
               "the step's peak memory above what was held before it (weights and gradient buffers; exact\n"
               "bytes of tempo's CPU allocator, or CUDA's allocated bytes), its time (median of R rounds\n"
               "after a warm-up, configurations interleaved), and the relative L2 distance of all\n"
               "parameter gradients to full backpropagation's. Methods: eager (torch's GELU and\n"
               "LayerNorm) or tempo (in place: the Performer block keeps their outputs only).\n");
}

namespace {

std::vector<std::string> split(const std::string& s) { return split_list(s); }
int64_t positive(const std::string& flag, const std::string& v) { return parse_int("tempo slim", flag, v); }

PerformerConfig config_of(const SlimOptions& o) {
  PerformerConfig c = PerformerConfig::preset(o.preset);
  if (o.seq) c.max_len = o.seq;
  if (o.layers) c.layers = o.layers;
  if (o.d_model) c.d_model = o.d_model;
  if (o.heads) c.heads = o.heads;
  if (o.ffn) c.ffn = o.ffn;
  if (!o.feature_map.empty()) c.feature_map = o.feature_map;
  if (!o.mode.empty()) c.mode = o.mode;
  c.validate();
  return c;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void progress(const SlimOptions& o, const std::string& what) {
  if (!isatty(2)) return;
  std::fprintf(stderr, "\r\033[K%s", what.c_str());
  std::fflush(stderr);
}

std::string chunk_name(const std::optional<int64_t>& c) { return c ? std::to_string(*c) : "full"; }

}  // namespace

SlimOptions parse_slim_args(const std::vector<std::string>& args) {
  SlimOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string k = current_flag("tempo slim", args[i]);
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument("tempo slim: " + k + " needs a value");
      return args[++i];
    };
    if (k == "--preset")
      o.preset = value();
    else if (k == "--seq")
      o.seq = positive(k, value());
    else if (k == "--batch")
      o.batch = positive(k, value());
    else if (k == "--chunks") {
      o.chunks.clear();
      for (const auto& c : split(value())) {
        if (c == "full")
          o.chunks.push_back(std::nullopt);
        else
          o.chunks.push_back(positive("--chunks", c));
      }
      if (o.chunks.empty()) throw std::invalid_argument("tempo slim: --chunks is empty");
    } else if (k == "--methods")
      o.methods = split(value());
    else if (k == "--layers")
      o.layers = positive(k, value());
    else if (k == "--d-model")
      o.d_model = positive(k, value());
    else if (k == "--heads")
      o.heads = positive(k, value());
    else if (k == "--ffn")
      o.ffn = positive(k, value());
    else if (k == "--feature-map")
      o.feature_map = value();
    else if (k == "--mode")
      o.mode = value();
    else if (k == "--dtype")
      o.dtype = value();
    else if (k == "--device")
      o.device = value();
    else if (k == "--repeats")
      o.repeats = static_cast<int>(positive(k, value()));
    else if (k == "--seed")
      o.seed = static_cast<uint64_t>(positive(k, value()));
    else if (k == "--json")
      o.json = true;
    else if (k == "--plot")
      o.plot = value();
    else
      throw std::invalid_argument("tempo slim: unknown argument '" + k + "'");
  }
  if (o.seq == 1) throw std::invalid_argument("tempo slim: --seq must be at least 2");
  if (o.dtype != "fp32" && o.dtype != "fp64")
    throw std::invalid_argument("tempo slim: --dtype must be fp32 or fp64, got '" + o.dtype + "'");
  if (o.device != "cpu" && o.device != "cuda")
    throw std::invalid_argument("tempo slim: --device must be cpu or cuda, got '" + o.device + "'");
  if (o.methods.empty()) throw std::invalid_argument("tempo slim: --methods is empty");
  for (const auto& p : o.methods)
    if (p != "eager" && p != "tempo")
      throw std::invalid_argument("tempo slim: --methods takes eager and tempo, got '" + p + "'");
  if (!o.plot.empty()) check_output("tempo slim", "--plot", o.plot, /*svg=*/true);
  try {
    config_of(o);
  } catch (const c10::Error& e) {
    throw std::invalid_argument(e.what_without_backtrace());
  }
  return o;
}

std::vector<SlimResult> measure_slim(const SlimOptions& o) {
  const c10::Device device(o.device == "cuda" ? c10::kCUDA : c10::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available())
    throw std::invalid_argument("tempo slim: --device cuda but no CUDA device is available");
  if (device.is_cpu()) tempo::memory::track_cpu();
  const PerformerConfig c = config_of(o);
  const auto dtype = o.dtype == "fp64" ? at::kDouble : at::kFloat;
  // The full-backpropagation reference first: every discrepancy is measured against it.
  std::vector<std::optional<int64_t>> configs{std::nullopt};
  for (const auto& ch : o.chunks)
    if (ch) configs.push_back(ch);
  std::vector<SlimResult> out;
  for (const auto& method : o.methods) {
    torch::manual_seed(o.seed);  // the same weights and tokens under every method
    PerformerLM model(c, Method::parse(method));
    model->to(device, dtype);
    const at::Tensor tokens =
        at::randint(0, c.vocab, {o.batch, c.max_len + 1}, at::TensorOptions(device).dtype(at::kLong));
    std::vector<at::Tensor> params;
    for (auto& p : model->parameters()) {
      p.mutable_grad() = at::zeros_like(p);  // held before every step: the peaks count the step's own work
      params.push_back(p);
    }
    auto step = [&](const std::optional<int64_t>& chunk, at::Tensor* grads) {
      for (auto& p : params) p.mutable_grad().zero_();
      if (device.is_cuda()) torch::cuda::synchronize();
      tempo::memory::Scope scope(device);
      const double t0 = now_ms();
      const at::Tensor loss = chunk ? tempo::slim::loss_and_backward(model, tokens, chunk)
                                    : tempo::slim::full_loss_and_backward(model, tokens);
      if (device.is_cuda()) torch::cuda::synchronize();
      const double ms = now_ms() - t0;
      const int64_t peak = scope.peak();
      if (grads) {
        std::vector<at::Tensor> gs;
        for (auto& p : params) gs.push_back(p.grad().flatten().to(at::kDouble));
        *grads = at::cat(gs);
      }
      return std::make_tuple(peak, ms, loss.item<double>());
    };
    std::vector<SlimResult> rows;
    std::vector<at::Tensor> grads(configs.size());
    for (size_t i = 0; i < configs.size(); ++i) {  // also the warm-up
      progress(o, method + ": warm-up, chunk " + chunk_name(configs[i]));
      auto [peak, ms, loss] = step(configs[i], &grads[i]);
      SlimResult r;
      r.preset = c.name, r.method = method, r.dtype = o.dtype, r.device = o.device;
      r.seq = c.max_len, r.batch = o.batch, r.chunk = configs[i], r.peak_bytes = peak, r.loss = loss;
      r.grad_rel_discrepancy = ((grads[i] - grads[0]).norm() / grads[0].norm().clamp_min(1e-300)).item<double>();
      rows.push_back(r);
    }
    std::vector<std::vector<double>> times(configs.size());
    for (int round = 0; round < o.repeats; ++round)  // interleaved: drift on a shared machine hits all alike
      for (size_t i = 0; i < configs.size(); ++i) {
        progress(o, method + ": round " + std::to_string(round + 1) + ", chunk " + chunk_name(configs[i]));
        times[i].push_back(std::get<1>(step(configs[i], nullptr)));
      }
    for (size_t i = 0; i < configs.size(); ++i) {
      std::sort(times[i].begin(), times[i].end());
      const size_t n = times[i].size();
      rows[i].step_ms = n % 2 ? times[i][n / 2] : (times[i][n / 2 - 1] + times[i][n / 2]) / 2;
    }
    // In the order asked for (full where --chunks put it, or last).
    for (const auto& ch : o.chunks)
      for (const auto& r : rows)
        if (r.chunk == ch) out.push_back(r);
    if (std::find(o.chunks.begin(), o.chunks.end(), std::nullopt) == o.chunks.end()) out.push_back(rows[0]);
  }
  progress(o, "");
  return out;
}

int run_slim(const SlimOptions& o) {
  const std::vector<SlimResult> rows = measure_slim(o);
  auto full_of = [&](const SlimResult& r) -> const SlimResult& {
    for (const auto& f : rows)
      if (f.method == r.method && !f.chunk) return f;
    return r;
  };
  if (o.json) {
    std::printf("[");
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      std::printf(
          "%s\n  {\"preset\": \"%s\", \"method\": \"%s\", \"seq\": %lld, \"batch\": %lld, \"dtype\": \"%s\", "
          "\"device\": \"%s\", \"chunk\": %s, \"peak_bytes\": %lld, \"step_ms\": %.3f, \"loss\": %.9g, "
          "\"grad_rel_discrepancy\": %.6g}",
          i ? "," : "", r.preset.c_str(), r.method.c_str(), (long long)r.seq, (long long)r.batch, r.dtype.c_str(),
          r.device.c_str(), r.chunk ? std::to_string(*r.chunk).c_str() : "null", (long long)r.peak_bytes, r.step_ms,
          r.loss, r.grad_rel_discrepancy);
    }
    std::printf("\n]\n");
  } else {
    std::printf(
        "%s, L = %lld, batch %lld, %s, %s (peak: bytes above weights and gradients; discrepancy: relative "
        "L2 to full backprop)\n",
        rows[0].preset.c_str(), (long long)rows[0].seq, (long long)rows[0].batch, o.dtype.c_str(), o.device.c_str());
    std::printf("%-8s %-8s %14s %8s %12s %8s %13s %12s\n", "method", "chunk", "peak", "vs full", "step ms", "vs full",
                "discrepancy", "loss");
    for (const auto& r : rows) {
      const auto& f = full_of(r);
      std::printf("%-8s %-8s %10.2f MiB %7.3fx %12.1f %7.2fx %13.2e %12.6f\n", r.method.c_str(),
                  chunk_name(r.chunk).c_str(), r.peak_bytes / 1048576.0,
                  static_cast<double>(r.peak_bytes) / std::max<int64_t>(f.peak_bytes, 1), r.step_ms,
                  r.step_ms / std::max(f.step_ms, 1e-9), r.grad_rel_discrepancy, r.loss);
    }
  }
  if (!o.plot.empty()) {
    std::vector<std::string> labels;
    BarChart peak{"peak memory of a step (MiB, lower is better)", {}, {}};
    BarChart time{"step time (ms, lower is better)", {}, {}};
    for (const auto& r : rows) {
      labels.push_back((o.methods.size() > 1 ? r.method + " " : std::string()) + "chunk " + chunk_name(r.chunk));
      peak.values.push_back(r.peak_bytes / 1048576.0);
      time.values.push_back(r.step_ms);
    }
    write_bar_charts(
        o.plot,
        "tempo slim: " + rows[0].preset + ", L " + std::to_string(rows[0].seq) + ", " + o.dtype + ", " + o.device,
        labels, {peak, time});
    if (!o.json) std::printf("plot written to %s\n", o.plot.c_str());
  }
  return 0;
}

}  // namespace tempo::tools
