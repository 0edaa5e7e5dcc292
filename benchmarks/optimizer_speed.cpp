// One AdamW step over a model's parameters: tempo::train::AdamW (the trainer's: one pass per
// parameter) against torch::optim::AdamW (a chain of tensor ops), side by side in one run, with
// the bytes each allocates during the step beyond its state (exact, tempo's CPU allocator, or
// CUDA's allocated bytes).
//
//   build/bench_optimizer [--model bert-base] [--layers N] [--device cpu|cuda] [--reps 5]
//                         [--csv FILE] [--json FILE]
//
// ratio = tempo / torch (below 1: tempo faster). Both step their own copy of the parameters,
// with the same gradients; the first step (which makes the moments) is not timed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common.h"
#include "tempo/memory.h"
#include "tempo/models/transformer.h"
#include "tempo/train/adamw.h"

namespace {

int usage(int rc) {
  std::printf(
      "usage: bench_optimizer [--model bert-base] [--layers N] [--device cpu|cuda] [--reps 5]\n"
      "                       [--csv FILE] [--json FILE]\n");
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "bert-base", device = "cpu", csv, json;
  int64_t layers = 0;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") return usage(0);
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_optimizer: %s needs a value (or is unknown)\n", k.c_str());
      return usage(2);
    }
    const std::string v = argv[++i];
    try {
      if (k == "--model")
        model = v;
      else if (k == "--layers")
        layers = std::stoll(v);
      else if (k == "--device")
        device = v;
      else if (k == "--reps")
        reps = std::stoi(v);
      else if (k == "--csv")
        csv = v;
      else if (k == "--json")
        json = v;
      else {
        std::fprintf(stderr, "bench_optimizer: unknown argument %s\n", k.c_str());
        return usage(2);
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "bench_optimizer: %s takes a number, got '%s'\n", k.c_str(), v.c_str());
      return 2;
    }
  }
  if (reps <= 0 || layers < 0 || (device != "cpu" && device != "cuda")) {
    std::fprintf(stderr, "bench_optimizer: --reps must be positive, --layers >= 0, --device cpu or cuda\n");
    return 2;
  }
  const bool cuda = device == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_optimizer: --device cuda but no CUDA device is available\n");
    return 2;
  }
  const c10::Device dev(device);
  tempo::models::ModelConfig c;
  try {
    c = tempo::models::ModelConfig::preset(model);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_optimizer: %s\n", e.what());
    return 2;
  }
  if (layers) c.resize(0, layers, 0, 0);
  if (!cuda) tempo::memory::track_cpu();
  // The parameter shapes of the model, twice (one set per optimizer), with shared gradients.
  std::vector<at::Tensor> ours, theirs;
  int64_t numel = 0;
  {
    torch::manual_seed(0);
    tempo::models::TransformerModel m(c, tempo::models::Method::parse("eager"));
    for (const auto& p : m->parameters()) {
      const at::Tensor w = p.detach().to(dev);
      const at::Tensor g = at::randn_like(w) * 1e-3;
      ours.push_back(w.clone().requires_grad_());
      theirs.push_back(w.clone().requires_grad_());
      ours.back().mutable_grad() = g;
      theirs.back().mutable_grad() = g;
      numel += w.numel();
    }
  }
  const auto options = torch::optim::AdamWOptions(1e-4).weight_decay(0.01).eps(1e-6);
  tempo::train::AdamW a(ours, options);
  torch::optim::AdamW b(theirs, options);
  a.step();  // the moments made
  b.step();
  const auto step_peak = [&](torch::optim::Optimizer& o) {
    tempo::memory::Scope scope(dev);
    o.step();
    if (cuda) torch::cuda::synchronize();
    return scope.peak();
  };
  const int64_t peak_a = step_peak(a), peak_b = step_peak(b);
  const auto [ms_a, ms_b] = bench::time_pair([&] { a.step(); }, [&] { b.step(); }, reps, cuda);
  double max_diff = 0;
  for (size_t i = 0; i < ours.size(); ++i)
    max_diff = std::max(max_diff, (ours[i] - theirs[i]).abs().max().item<double>());
  std::printf("AdamW step, %s (%lld parameters in %zu tensors), %s, %d ATen threads, median of %d\n", model.c_str(),
              static_cast<long long>(numel), ours.size(), device.c_str(), at::get_num_threads(), reps);
  std::printf("%-10s %10s %10s %7s %16s %16s %12s\n", "optimizer", "tempo ms", "torch ms", "ratio", "tempo step B",
              "torch step B", "max |diff|");
  std::printf("%-10s %10.2f %10.2f %7.3f %16lld %16lld %12.3g\n", "adamw", ms_a, ms_b, ms_a / ms_b,
              static_cast<long long>(peak_a), static_cast<long long>(peak_b), max_diff);
  bench::Records rec;
  rec.add({{"model", bench::Records::str(model)},
           {"device", bench::Records::str(device)},
           {"parameters", bench::Records::num(numel)},
           {"threads", bench::Records::num(at::get_num_threads())},
           {"tempo_ms", bench::Records::num(ms_a)},
           {"torch_ms", bench::Records::num(ms_b)},
           {"ratio", bench::Records::num(ms_a / ms_b)},
           {"tempo_step_bytes", bench::Records::num(peak_a)},
           {"torch_step_bytes", bench::Records::num(peak_b)},
           {"max_abs_diff", bench::Records::num(max_diff)}});
  rec.write_csv(csv);
  rec.write_json(json);
  return 0;
}
