// fwd+bwd time of tempo's in-place activations against PyTorch's own ops, side by side in
// one run, with the bytes each keeps for backward.
//
//   build/bench_activation [--tokens 4096,16384] [--features 4096] [--dtype float32|bfloat16]
//                          [--device cpu|cuda] [--reps 5] [--csv FILE] [--json FILE]
//
// Each measurement runs tempo and torch alternately, `reps` times after one warm-up, and
// reports the medians and their ratio (tempo / torch: below 1 means tempo is faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common.h"
#include "tempo/ops/activation.h"

namespace {

struct Args {
  std::vector<int64_t> tokens{4096, 16384};
  int64_t features = 4096;
  std::string dtype = "float32";
  std::string device = "cpu";
  int reps = 5;
  std::string csv, json;
};

void sync(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

double time_once(const std::function<at::Tensor(const at::Tensor&)>& f, const at::Tensor& x, const at::Tensor& g) {
  sync(x.device());
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor y = f(x);
  y.backward(g);
  sync(x.device());
  const auto t1 = std::chrono::steady_clock::now();
  x.mutable_grad() = at::Tensor();
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_activation: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--tokens")
      a.tokens = bench::parse_list(next());
    else if (k == "--features")
      a.features = std::stoll(next());
    else if (k == "--dtype")
      a.dtype = next();
    else if (k == "--device")
      a.device = next();
    else if (k == "--reps")
      a.reps = std::stoi(next());
    else if (k == "--csv")
      a.csv = next();
    else if (k == "--json")
      a.json = next();
    else if (k == "--help" || k == "-h") {
      std::printf(
          "usage: bench_activation [--tokens 4096,16384] [--features 4096] [--dtype float32|bfloat16|float16]\n"
          "                        [--device cpu|cuda] [--reps 5] [--csv FILE] [--json FILE]\n");
      return 0;
    } else {
      std::fprintf(stderr, "bench_activation: unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  if (a.dtype != "float32" && a.dtype != "bfloat16" && a.dtype != "float16") {
    std::fprintf(stderr, "bench_activation: --dtype must be float32, bfloat16 or float16, got %s\n", a.dtype.c_str());
    return 2;
  }
  if (a.tokens.empty() || a.features <= 0 || a.reps <= 0) {
    std::fprintf(stderr, "bench_activation: --tokens, --features and --reps must be positive\n");
    return 2;
  }
  const at::ScalarType dt = a.dtype == "bfloat16" ? at::kBFloat16 : a.dtype == "float16" ? at::kHalf : at::kFloat;
  const at::Device dev(a.device);
  if (dev.is_cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_activation: --device cuda but no CUDA device is available\n");
    return 2;
  }
  struct Variant {
    const char* name;
    std::function<at::Tensor(const at::Tensor&)> tempo, torch;
  };
  const std::vector<Variant> variants = {
      {"gelu", [](const at::Tensor& x) { return tempo::gelu(x); }, [](const at::Tensor& x) { return at::gelu(x); }},
      {"gelu_tanh", [](const at::Tensor& x) { return tempo::gelu(x, "tanh"); },
       [](const at::Tensor& x) { return at::gelu(x, "tanh"); }},
      {"silu", [](const at::Tensor& x) { return tempo::silu(x); }, [](const at::Tensor& x) { return at::silu(x); }},
  };
  std::printf("activation fwd+bwd, %s, %s, %d ATen threads, median of %d\n", a.dtype.c_str(), a.device.c_str(),
              at::get_num_threads(), a.reps);
  std::printf("%-10s %8s %6s %12s %12s %8s %14s %14s\n", "op", "tokens", "feat", "tempo ms", "torch ms", "ratio",
              "torch kept B", "tempo kept B");
  std::ostringstream csv, json;
  csv << "op,dtype,device,tokens,features,tempo_ms,torch_ms,ratio,torch_saved_bytes,tempo_saved_bytes\n";
  json << "[";
  bool first = true;
  for (int64_t tokens : a.tokens) {
    at::Tensor x = at::randn({tokens, a.features}, at::TensorOptions().dtype(dt).device(dev)) * 3;
    x.set_requires_grad(true);
    const at::Tensor g = at::randn_like(x);
    const int64_t n = x.numel();
    // What each keeps for backward beyond the output that the next layer keeps anyway:
    // torch the input (n elements), tempo the packed mask (ceil(n / 8) bytes).
    const int64_t torch_bytes = n * static_cast<int64_t>(x.element_size());
    const int64_t tempo_bytes = (n + 7) / 8;
    for (const auto& v : variants) {
      std::vector<double> tt, tr;
      time_once(v.tempo, x, g);
      time_once(v.torch, x, g);
      for (int r = 0; r < a.reps; ++r) {
        tt.push_back(time_once(v.tempo, x, g));
        tr.push_back(time_once(v.torch, x, g));
      }
      const double mt = bench::median(tt), mr = bench::median(tr);
      std::printf("%-10s %8lld %6lld %12.2f %12.2f %8.3f %14lld %14lld\n", v.name, (long long)tokens,
                  (long long)a.features, mt, mr, mt / mr, (long long)torch_bytes, (long long)tempo_bytes);
      std::fflush(stdout);
      csv << v.name << "," << a.dtype << "," << a.device << "," << tokens << "," << a.features << "," << mt << "," << mr
          << "," << mt / mr << "," << torch_bytes << "," << tempo_bytes << "\n";
      json << (first ? "" : ",") << "\n  {\"op\": \"" << v.name << "\", \"dtype\": \"" << a.dtype
           << "\", \"device\": \"" << a.device << "\", \"tokens\": " << tokens << ", \"features\": " << a.features
           << ", \"tempo_ms\": " << mt << ", \"torch_ms\": " << mr << ", \"ratio\": " << mt / mr
           << ", \"torch_saved_bytes\": " << torch_bytes << ", \"tempo_saved_bytes\": " << tempo_bytes << "}";
      first = false;
    }
  }
  json << "\n]\n";
  if (!a.csv.empty()) std::ofstream(a.csv) << csv.str();
  if (!a.json.empty()) std::ofstream(a.json) << json.str();
  return 0;
}
