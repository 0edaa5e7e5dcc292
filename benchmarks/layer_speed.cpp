// fwd+bwd time of one transformer encoder layer under methods, side by side: each
// method alternated with eager in one run (bench::time_pair), median of --reps, with the bytes
// the layer keeps for backward (the memory tracker's exact count, CPU only) and the bytes its
// operators move (tempo::memory::TrafficScope, forward + backward).
//
//   build/bench_layer [--model bert-large] [--seq 128,512] [--batch 1] [--methods eager,tempo,tempo-fused]
//                     [--dtype float32|bfloat16] [--device cpu|cuda] [--reps 5] [--csv F] [--json F]
//
// The layer is the models' TransformerLayer (post-LN for BERT/RoBERTa, pre-LN for GPT-2/LLaMA)
// with the preset's hidden size, heads, FFN size and dropout, in training mode.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <cstdio>
#include <string>

#include "common.h"
#include "tempo/memory.h"
#include "tempo/models.h"

namespace {

struct Args {
  std::string model = "bert-large";
  std::vector<int64_t> seq{128, 512};
  int64_t batch = 1;
  std::vector<std::string> methods{"eager", "tempo", "tempo-fused"};
  std::string dtype = "float32", device = "cpu";
  int reps = 5;
  std::string csv, json;
};

int usage(int rc) {
  std::printf(
      "usage: bench_layer [--model bert-large] [--seq 128,512] [--batch 1] [--methods eager,tempo,tempo-fused]\n"
      "                   [--dtype float32|bfloat16] [--device cpu|cuda] [--reps 5] [--csv F] [--json F]\n");
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tempo::models;
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") return usage(0);
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_layer: %s needs a value (or is unknown)\n", k.c_str());
      return usage(2);
    }
    const std::string v = argv[++i];
    if (k == "--model")
      a.model = v;
    else if (k == "--seq")
      a.seq = bench::parse_list(v);
    else if (k == "--batch")
      a.batch = std::stoll(v);
    else if (k == "--methods")
      a.methods = bench::split(v);
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
      std::fprintf(stderr, "bench_layer: unknown argument %s\n", k.c_str());
      return usage(2);
    }
  }
  if (a.dtype != "float32" && a.dtype != "bfloat16") {
    std::fprintf(stderr, "bench_layer: --dtype must be float32 or bfloat16, got %s\n", a.dtype.c_str());
    return 2;
  }
  if (a.seq.empty() || a.batch <= 0 || a.reps <= 0 || a.methods.empty()) {
    std::fprintf(stderr, "bench_layer: --seq, --batch, --reps and --methods must be non-empty / positive\n");
    return 2;
  }
  const at::Device dev(a.device);
  const bool cuda = dev.is_cuda();
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_layer: --device cuda but no CUDA device is available\n");
    return 2;
  }
  try {
    const ModelConfig c = ModelConfig::preset(a.model);
    const at::ScalarType dt = a.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
    if (!cuda) tempo::memory::track_cpu();
    std::printf(
        "one %s layer fwd+bwd (hidden %lld, heads %lld, FFN %lld, dropout %.2f), %s, %s, batch %lld, "
        "%d threads, median of %d, each method alternated with eager\n",
        a.model.c_str(), (long long)c.hidden, (long long)c.heads, (long long)c.intermediate, c.dropout, a.dtype.c_str(),
        a.device.c_str(), (long long)a.batch, at::get_num_threads(), a.reps);
    std::printf("%-14s %6s %10s %10s %14s %14s\n", "method", "seq", "ms", "vs eager", "kept MiB", "moved MiB");
    bench::Records rec;
    for (int64_t S : a.seq) {
      struct Layer {
        std::string name;
        TransformerLayer layer{nullptr};
      };
      std::vector<Layer> layers;
      for (const auto& name : a.methods) {
        torch::manual_seed(0);  // the same weights under every method
        auto ops = std::make_shared<const MethodOps>(Method::parse(name));
        TransformerLayer l(c, ops);
        l->to(dev, dt);
        l->train();
        layers.push_back({name, l});
      }
      torch::manual_seed(1);
      const at::Tensor x = at::randn({a.batch, S, c.hidden}, at::TensorOptions().dtype(dt).device(dev));
      const at::Tensor g = at::randn_like(x);
      auto step = [&](TransformerLayer& l) {
        at::Tensor xi = x.detach().requires_grad_(true);
        l->forward(xi, at::Tensor()).backward(g);
        for (auto& p : l->parameters()) p.mutable_grad() = at::Tensor();
      };
      TransformerLayer eager = layers.front().layer;
      double eager_ms = 0;
      for (auto& L : layers) {
        // kept: bytes held after the forward (the output included; the CPU tracker, or CUDA's
        // caching allocator's count of allocated bytes); moved: the operators' traffic over
        // forward + backward
        int64_t kept = 0;
        {
          tempo::memory::Scope scope(dev);
          at::Tensor xi = x.detach().requires_grad_(true);
          at::Tensor y = L.layer->forward(xi, at::Tensor());
          kept = scope.held();
        }
        int64_t moved = 0;
        {
          tempo::memory::TrafficScope traffic;
          step(L.layer);
          moved = traffic.total();
        }
        double ms;
        if (&L == &layers.front()) {
          ms = eager_ms = bench::time_pair([&] { step(L.layer); }, [&] { step(L.layer); }, a.reps, cuda).first;
        } else {
          auto [mt, me] = bench::time_pair([&] { step(L.layer); }, [&] { step(eager); }, a.reps, cuda);
          ms = mt, eager_ms = me;
        }
        std::printf("%-14s %6lld %10.2f %10.3f %14.2f %14.2f\n", L.name.c_str(), (long long)S, ms, ms / eager_ms,
                    kept / 1048576.0, moved / 1048576.0);
        std::fflush(stdout);
        using R = bench::Records;
        rec.add({{"method", R::str(L.name)},
                 {"model", R::str(a.model)},
                 {"dtype", R::str(a.dtype)},
                 {"device", R::str(a.device)},
                 {"batch", R::num(a.batch)},
                 {"seq", R::num(S)},
                 {"ms", R::num(ms)},
                 {"eager_ms", R::num(eager_ms)},
                 {"ratio_vs_eager", R::num(ms / eager_ms)},
                 {"kept_bytes", R::num(kept)},
                 {"bytes_moved", R::num(moved)}});
      }
    }
    rec.write_csv(a.csv);
    rec.write_json(a.json);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_layer: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
