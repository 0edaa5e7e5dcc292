// fwd+bwd time of the attention cores (tempo, sdpa, eager) side by side, with the bytes each
// keeps for backward beyond q, k, v and the output.
//
//   build/bench_attention [--seq 128,512,2048] [--batch 1] [--heads 16] [--head-dim 64] [--p 0.1]
//                         [--dtype float32|bfloat16] [--device cpu|cuda] [--reps 3] [--csv F] [--json F]
//
// Ratios are against eager (the plain PyTorch baseline). Kept bytes per probability:
// eager 9 (P, byte mask, dropped P; fp32), tempo 4 + 1/8 (P, bits), sdpa with dropout on CPU
// 13 (torch's math fallback), sdpa without dropout none (its fused kernel keeps one fp32
// log-sum-exp per row); tests/python/ops/test_attention.py asserts them exactly.
// "tempo, strided q/k/v" runs tempo on the strided [B, A, S, d] views of one [B, S, 3, A, d]
// projection output (what a layer without tempo::qkv_split passes) instead of three contiguous
// tensors (what qkv_split writes): the layout question of the fused layer kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <cstdio>
#include <string>

#include "common.h"
#include "tempo/nn/attention.h"
#include "tempo/ops/attention.h"
#include "tempo/ops/fused_attention.h"

namespace {

struct Args {
  std::vector<int64_t> seq{128, 512, 2048};
  int64_t batch = 1, heads = 16, head_dim = 64;
  double p = 0.1;
  std::string dtype = "float32", device = "cpu";
  int reps = 3;
  std::string csv, json;
};

int usage(int rc) {
  std::printf(
      "usage: bench_attention [--seq 128,512,2048] [--batch 1] [--heads 16] [--head-dim 64] [--p 0.1]\n"
      "                       [--dtype float32|bfloat16|float16] [--device cpu|cuda] [--reps 3] [--csv F] [--json "
      "F]\n");
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") return usage(0);
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_attention: %s needs a value (or is unknown)\n", k.c_str());
      return usage(2);
    }
    const std::string v = argv[++i];
    if (k == "--seq")
      a.seq = bench::parse_list(v);
    else if (k == "--batch")
      a.batch = std::stoll(v);
    else if (k == "--heads")
      a.heads = std::stoll(v);
    else if (k == "--head-dim")
      a.head_dim = std::stoll(v);
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
      std::fprintf(stderr, "bench_attention: unknown argument %s\n", k.c_str());
      return usage(2);
    }
  }
  if (a.dtype != "float32" && a.dtype != "bfloat16" && a.dtype != "float16") {
    std::fprintf(stderr, "bench_attention: --dtype must be float32, bfloat16 or float16, got %s\n", a.dtype.c_str());
    return 2;
  }
  if (a.seq.empty() || a.batch <= 0 || a.heads <= 0 || a.head_dim <= 0 || a.reps <= 0 || !(a.p >= 0 && a.p < 1)) {
    std::fprintf(stderr, "bench_attention: sizes and --reps must be positive, --p in [0, 1)\n");
    return 2;
  }
  const at::ScalarType dt = a.dtype == "bfloat16" ? at::kBFloat16 : a.dtype == "float16" ? at::kHalf : at::kFloat;
  const at::Device dev(a.device);
  const bool cuda = dev.is_cuda();
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_attention: --device cuda but no CUDA device is available\n");
    return 2;
  }
  const auto opts = at::TensorOptions().dtype(dt).device(dev);
  std::printf(
      "attention core fwd+bwd, %s, %s, batch %lld, heads %lld, head dim %lld, dropout %.2f, %d threads, "
      "median of %d\n",
      a.dtype.c_str(), a.device.c_str(), (long long)a.batch, (long long)a.heads, (long long)a.head_dim, a.p,
      at::get_num_threads(), a.reps);
  std::printf("%-22s %6s %10s %10s %14s %16s\n", "backend", "seq", "ms", "vs eager", "kept B", "kept vs eager");
  bench::Records rec;
  for (int64_t S : a.seq) {
    at::Tensor q = at::randn({a.batch, a.heads, S, a.head_dim}, opts).requires_grad_(true);
    at::Tensor k = at::randn({a.batch, a.heads, S, a.head_dim}, opts).requires_grad_(true);
    at::Tensor v = at::randn({a.batch, a.heads, S, a.head_dim}, opts).requires_grad_(true);
    const at::Tensor g = at::randn({a.batch, a.heads, S, a.head_dim}, opts);
    const at::Tensor z = at::randn({a.batch, S, 3, a.heads, a.head_dim}, opts).permute({2, 0, 3, 1, 4});
    at::Tensor qs = z[0].detach().requires_grad_(true), ks = z[1].detach().requires_grad_(true),
               vs = z[2].detach().requires_grad_(true);
    const double p = a.p;
    const int64_t s2 = a.batch * a.heads * S * S, e = at::elementSize(dt);
    struct Case {
      std::string name;
      std::function<at::Tensor()> f;
      int64_t kept;
    };
    const int64_t lse = a.batch * a.heads * S * 4;
    const std::vector<Case> cases = {
        {"eager", [&] { return tempo::nn::eager_attention(q, k, v, std::nullopt, p, false); },
         p > 0 ? s2 * (2 * e + 1) : s2 * e},
        {"tempo", [&] { return tempo::attention(q, k, v, std::nullopt, p); }, s2 * e + (p > 0 ? (s2 + 7) / 8 : 0)},
        {"sdpa", [&] { return tempo::nn::sdpa_attention(q, k, v, std::nullopt, p, false); },
         p > 0 && !cuda ? s2 * (3 * e + 1) : lse},
        {"sdpa (no dropout)", [&] { return tempo::nn::sdpa_attention(q, k, v, std::nullopt, 0.0, false); }, lse},
        {"tempo, strided q/k/v", [&] { return tempo::attention(qs, ks, vs, std::nullopt, p); },
         s2 * e + (p > 0 ? (s2 + 7) / 8 : 0)},
    };
    double eager_ms = 0;
    int64_t eager_kept = 0;
    for (const auto& c : cases) {
      auto run = [&] {
        c.f().backward(g);
        for (auto t : {q, k, v, qs, ks, vs}) t.mutable_grad() = at::Tensor();
      };
      // Each backend against eager, alternated in one run.
      auto eager = [&] {
        cases[0].f().backward(g);
        for (auto t : {q, k, v}) t.mutable_grad() = at::Tensor();
      };
      double ms;
      if (c.name == "eager") {
        ms = bench::time_pair(run, run, a.reps, cuda).first;
        eager_ms = ms;
        eager_kept = c.kept;
      } else {
        auto [mt, me] = bench::time_pair(run, eager, a.reps, cuda);
        ms = mt;
        eager_ms = me;
      }
      std::printf("%-22s %6lld %10.2f %10.3f %14lld %16.3f\n", c.name.c_str(), (long long)S, ms, ms / eager_ms,
                  (long long)c.kept, static_cast<double>(c.kept) / static_cast<double>(eager_kept));
      std::fflush(stdout);
      using R = bench::Records;
      rec.add({{"backend", R::str(c.name)},
               {"dtype", R::str(a.dtype)},
               {"device", R::str(a.device)},
               {"batch", R::num(a.batch)},
               {"heads", R::num(a.heads)},
               {"seq", R::num(S)},
               {"head_dim", R::num(a.head_dim)},
               {"p", R::num(p)},
               {"ms", R::num(ms)},
               {"eager_ms", R::num(eager_ms)},
               {"ratio_vs_eager", R::num(ms / eager_ms)},
               {"kept_bytes", R::num(c.kept)},
               {"eager_kept_bytes", R::num(eager_kept)}});
    }
  }
  rec.write_csv(a.csv);
  rec.write_json(a.json);
  return 0;
}
