// fwd+bwd time of tempo's norms, dropout and fused bias-dropout-residual-LayerNorm against
// PyTorch's own ops (the fused op against the unfused torch sequence), side by side in one
// run, with the bytes each keeps for backward.
//
//   build/bench_norm [--tokens 4096,16384] [--hidden 1024] [--p 0.1] [--dtype float32|bfloat16]
//                    [--device cpu|cuda] [--reps 5] [--csv FILE] [--json FILE]
//
// Each row: medians of `reps` alternated runs; ratio = tempo / torch (below 1: tempo faster).
// Kept bytes are what each keeps beyond tensors the neighbouring layers keep anyway; the
// Python tests assert them exactly with saved-tensor hooks (tests/python/ops/test_norm.py,
// test_dropout.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <cstdio>
#include <string>

#include "common.h"
#include "tempo/ops/dropout.h"
#include "tempo/ops/norm.h"

namespace {

struct Args {
  std::vector<int64_t> tokens{4096, 16384};
  int64_t hidden = 1024;
  double p = 0.1;
  std::string dtype = "float32", device = "cpu";
  int reps = 5;
  std::string csv, json;
};

int usage(int rc) {
  std::printf(
      "usage: bench_norm [--tokens 4096,16384] [--hidden 1024] [--p 0.1] [--dtype float32|bfloat16|float16]\n"
      "                  [--device cpu|cuda] [--reps 5] [--csv FILE] [--json FILE]\n");
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") return usage(0);
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_norm: %s needs a value (or is unknown)\n", k.c_str());
      return usage(2);
    }
    const std::string v = argv[++i];
    if (k == "--tokens")
      a.tokens = bench::parse_list(v);
    else if (k == "--hidden")
      a.hidden = std::stoll(v);
    else if (k == "--p")
      a.p = std::stod(v);
    else if (k == "--dtype")
      a.dtype = v;
    else if (k == "--device")
      a.device = v;
    else if (k == "--reps")
      a.reps = std::stoi(v);
    else if (k == "--csv")
      a.csv = v;
    else if (k == "--json")
      a.json = v;
    else {
      std::fprintf(stderr, "bench_norm: unknown argument %s\n", k.c_str());
      return usage(2);
    }
  }
  if (a.dtype != "float32" && a.dtype != "bfloat16" && a.dtype != "float16") {
    std::fprintf(stderr, "bench_norm: --dtype must be float32, bfloat16 or float16, got %s\n", a.dtype.c_str());
    return 2;
  }
  if (a.tokens.empty() || a.hidden <= 0 || a.reps <= 0 || !(a.p > 0 && a.p < 1)) {
    std::fprintf(stderr, "bench_norm: --tokens, --hidden, --reps must be positive and --p in (0, 1)\n");
    return 2;
  }
  const at::ScalarType dt = a.dtype == "bfloat16" ? at::kBFloat16 : a.dtype == "float16" ? at::kHalf : at::kFloat;
  const at::Device dev(a.device);
  const bool cuda = dev.is_cuda();
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_norm: --device cuda but no CUDA device is available\n");
    return 2;
  }
  const auto opts = at::TensorOptions().dtype(dt).device(dev);
  std::printf("norms and dropout fwd+bwd, %s, %s, hidden %lld, p %.2f, %d ATen threads, median of %d\n",
              a.dtype.c_str(), a.device.c_str(), (long long)a.hidden, a.p, at::get_num_threads(), a.reps);
  std::printf("%-22s %8s %10s %10s %7s %14s %14s\n", "op", "tokens", "tempo ms", "torch ms", "ratio", "torch kept B",
              "tempo kept B");
  bench::Records rec;
  for (int64_t tokens : a.tokens) {
    const int64_t H = a.hidden, n = tokens * H, e = at::elementSize(dt);
    auto leaf = [&](at::Tensor t) { return t.requires_grad_(true); };
    at::Tensor x = leaf(at::randn({tokens, H}, opts));
    at::Tensor res = leaf(at::randn({tokens, H}, opts));
    at::Tensor bias = leaf(at::randn({H}, opts) * 0.1);
    at::Tensor gamma = leaf(at::randn({H}, opts) * 0.3 + 1);
    at::Tensor beta = leaf(at::randn({H}, opts) * 0.1);
    const at::Tensor g = at::randn({tokens, H}, opts);
    const std::vector<at::Tensor> leaves{x, res, bias, gamma, beta};
    auto run = [&](const std::function<at::Tensor()>& f) {
      return [&, f]() {
        f().backward(g);
        for (auto t : leaves) t.mutable_grad() = at::Tensor();
      };
    };
    // torch's LayerNorm keeps x, mean and rstd (x's dtype); its rms_norm (fp32 composite) x and
    // the normalised x in fp32 and rstd; its CPU dropout a noise tensor in x's dtype (on CUDA a
    // bool mask); tempo keeps rstd (fp32) and the bits.
    struct Case {
      const char* name;
      std::function<at::Tensor()> tempo, torch;
      int64_t torch_bytes, tempo_bytes;
    };
    const double p = a.p;
    const std::vector<Case> cases = {
        {"layer_norm", [&] { return tempo::layer_norm(x, {H}, gamma, beta); },
         [&] { return at::layer_norm(x, {H}, gamma, beta); }, n * e + 2 * tokens * e, tokens * 4},
        {"rms_norm", [&] { return tempo::rms_norm(x, {H}, gamma, 1e-6); },
         [&] { return at::rms_norm(x, {H}, gamma, 1e-6); }, 2 * n * 4 + tokens * 4, tokens * 4},
        {"dropout(bits)", [&] { return tempo::dropout(x, p, true, "bits"); }, [&] { return at::dropout(x, p, true); },
         n * (cuda ? 1 : e), (n + 7) / 8},
        {"dropout(philox)", [&] { return tempo::dropout(x, p, true, "philox"); },
         [&] { return at::dropout(x, p, true); }, n * (cuda ? 1 : e), 16},
        {"bias_dropout_add_ln", [&] { return tempo::bias_dropout_add_layer_norm(x, bias, res, p, gamma, beta); },
         [&] { return at::layer_norm(res + at::dropout(x + bias, p, true), {H}, gamma, beta); },
         n * (cuda ? 1 : e) + n * e + 2 * tokens * e, (n + 7) / 8 + tokens * 4},
    };
    for (const auto& c : cases) {
      auto [mt, mr] = bench::time_pair(run(c.tempo), run(c.torch), a.reps, cuda);
      std::printf("%-22s %8lld %10.2f %10.2f %7.3f %14lld %14lld\n", c.name, (long long)tokens, mt, mr, mt / mr,
                  (long long)c.torch_bytes, (long long)c.tempo_bytes);
      std::fflush(stdout);
      using R = bench::Records;
      rec.add({{"op", R::str(c.name)},
               {"dtype", R::str(a.dtype)},
               {"device", R::str(a.device)},
               {"tokens", R::num(tokens)},
               {"hidden", R::num(H)},
               {"p", R::num(p)},
               {"tempo_ms", R::num(mt)},
               {"torch_ms", R::num(mr)},
               {"ratio", R::num(mt / mr)},
               {"torch_saved_bytes", R::num(c.torch_bytes)},
               {"tempo_saved_bytes", R::num(c.tempo_bytes)}});
    }
  }
  rec.write_csv(a.csv);
  rec.write_json(a.json);
  return 0;
}
