// Models, methods, the memory tracker, activation checkpointing and the checked
// file writer, from LibTorch.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <unistd.h>

#include "tempo/models.h"
#include "tempo/models/file_write.h"
#include "tempo/models/hf_files.h"

namespace {

using tempo::models::Batch;
using tempo::models::Method;
using tempo::models::ModelConfig;

TEST(MemoryTracker, CountsAKnownAllocationExactly) {
  tempo::memory::track_cpu();
  const c10::Device cpu(c10::kCPU);
  tempo::memory::Scope scope(cpu);
  {
    at::Tensor a = at::empty({1000}, at::kFloat);
    at::Tensor b = at::empty({3, 7}, at::kByte);
    EXPECT_EQ(scope.held(), 4000 + 21);
    a.reset();
    EXPECT_EQ(scope.held(), 21);
  }
  EXPECT_EQ(scope.held(), 0);
  EXPECT_EQ(scope.peak(), 4021);
}

// The traffic account against sizes written out from the shapes, one operation per scope
// (how an operation splits into kernels is torch's business; the sum is what it moves): an
// elementwise op reads its operands and writes its result; a view moves nothing; an in-place
// op reads and writes self; fill_ only writes; a broadcast operand counts its distinct
// elements; a composite (linear) moves each operand and its result once; autograd's backward
// is counted under its own label. A scalar operand wrapped in a tensor adds at most 12 bytes.
TEST(MemoryTracker, TrafficOfKnownOpsIsTheirOperandsAndResults) {
  const at::Tensor a = at::randn({1000}), b = at::randn({1000}), row = at::randn({1, 250});
  const at::Tensor x = at::randn({8, 64}), w = at::randn({32, 64}), bias = at::randn({32});
  at::Tensor c = at::randn({1000});
  struct Moved {
    int64_t read = 0, written = 0;
    std::vector<tempo::memory::OpTraffic> ops;
  };
  auto measure = [](const std::function<void()>& f) {
    Moved m;
    tempo::memory::TrafficScope scope;
    f();
    m.ops = scope.ops();
    for (const auto& o : m.ops) m.read += o.read, m.written += o.written;
    EXPECT_EQ(scope.total(), m.read + m.written);
    return m;
  };
  auto near = [](int64_t got, int64_t want) { return got >= want && got <= want + 12; };
  Moved m = measure([&] { (void)at::add(a, b); });
  EXPECT_EQ(m.read, 2 * 4000);
  EXPECT_EQ(m.written, 4000);
  m = measure([&] { (void)a.view({10, 100}); });
  EXPECT_EQ(m.read + m.written, 0);
  m = measure([&] { c.mul_(2.0); });
  EXPECT_TRUE(near(m.read, 4000) && near(m.written, 4000)) << m.read << " " << m.written;
  m = measure([&] { c.fill_(1.0); });
  EXPECT_EQ(m.read, 0);
  EXPECT_TRUE(near(m.written, 4000)) << m.written;
  m = measure([&] { (void)at::add(a.view({4, 250}), row); });  // row broadcast over 4 rows: 1000 bytes once
  EXPECT_EQ(m.read, 4000 + 1000);
  EXPECT_EQ(m.written, 4000);
  m = measure([&] { (void)at::linear(x, w, bias); });
  EXPECT_EQ(m.read, (8 * 64 + 32 * 64 + 32) * 4);
  EXPECT_EQ(m.written, 8 * 32 * 4);
  for (const auto& o : m.ops) EXPECT_NE(o.op, "aten::linear");  // counted as its kernels
  at::Tensor p = at::randn({1000}).requires_grad_(true);
  {
    tempo::memory::TrafficScope scope("forward");
    at::Tensor loss = (p * p).sum();
    scope.set_phase("backward");
    loss.backward();
    int64_t backward = 0, forward = 0;
    for (const auto& o : scope.ops()) (o.phase == "backward" ? backward : forward) += o.read + o.written;
    EXPECT_EQ(forward, 4000 + 4000 + 4000 + 4);  // p * p (p read once, the product written), its sum
    EXPECT_GE(backward, 2 * 4000);               // the gradient 2 p g: p read and the gradient written at least
  }
  EXPECT_THROW(
      {
        tempo::memory::TrafficScope one;
        tempo::memory::TrafficScope two;
      },
      c10::Error);
}

// A reduced model of a preset's shape.
ModelConfig reduced(const std::string& preset, int64_t layers, int64_t vocab = 4096) {
  ModelConfig c = ModelConfig::preset(preset);
  c.layers = layers;
  c.vocab = vocab;
  return c;
}

// The training-length tests below run on one thread: CTest runs two tests at once on CI's two
// cores, and OpenMP's waiting threads slow each of a pair 3x or more (measured: 455 s for the
// mixed-precision test beside the fifty-step one, against 128 s on one thread each).
struct OneThread {
  int threads = at::get_num_threads();
  OneThread() { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(threads); }
};

std::vector<at::Tensor> grads_of(tempo::models::TransformerModel& m) {
  std::vector<at::Tensor> g;
  for (auto& p : m->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  return g;
}

// One forward + backward of `m` on `batch`: the loss, the bytes held after the forward (the
// tracker, which the caller has turned on) and every parameter's gradient.
struct Step {
  double loss = 0;
  int64_t held = 0;
  std::vector<at::Tensor> grads;
};
Step one_step(tempo::models::TransformerModel& m, const Batch& batch) {
  Step s;
  tempo::memory::Scope scope(c10::Device(c10::kCPU));
  at::Tensor l = m->loss(batch);
  s.held = scope.held();
  l.backward();
  s.loss = l.item<double>();
  s.grads = grads_of(m);
  return s;
}

TEST(Checkpoint, GradientsEqualWithDropoutOn) {
  for (const char* base : {"eager", "tempo"}) {
    ModelConfig c = reduced("bert-base", 2);
    c.hidden = 64;
    c.heads = 4;
    c.intermediate = 256;
    const Batch batch = tempo::models::synthetic_batch(c, 4, 32, 1);
    torch::manual_seed(0);
    auto plain = tempo::models::make_model(c, Method::parse(base));
    torch::manual_seed(0);
    auto ckpt = tempo::models::make_model(c, Method::parse(std::string(base) + "+ckpt"));
    torch::manual_seed(5);
    auto l1 = plain->loss(batch);
    l1.backward();
    torch::manual_seed(5);
    auto l2 = ckpt->loss(batch);
    l2.backward();
    EXPECT_EQ(l1.item<float>(), l2.item<float>()) << base;
    auto g1 = grads_of(plain), g2 = grads_of(ckpt);
    ASSERT_EQ(g1.size(), g2.size());
    for (size_t i = 0; i < g1.size(); ++i) EXPECT_TRUE(torch::allclose(g1[i], g2[i], 1e-6, 1e-7)) << base << " " << i;
  }
}

// Bytes held after the forward of one more encoder layer (steady state: the difference
// between 2 and 1 layers), bert-large, B=1, fp32, dropout on.
int64_t layer_bytes(const std::string& method, int64_t S) {
  tempo::memory::track_cpu();
  const c10::Device cpu(c10::kCPU);
  int64_t held[2];
  for (int layers = 1; layers <= 2; ++layers) {
    ModelConfig c = ModelConfig::preset("bert-large");
    c.layers = layers;
    c.vocab = 1024;
    torch::manual_seed(0);
    auto m = tempo::models::make_model(c, Method::parse(method));
    m->train();
    const at::Tensor ids = at::randint(2, c.vocab, {1, S}, at::kLong);
    tempo::memory::Scope scope(cpu);
    at::Tensor h = m->hidden_states(ids, at::Tensor());
    held[layers - 1] = scope.held();
  }
  return held[1] - held[0];
}

TEST(Models, PerLayerActivationBytesMatchTheModel) {
  const double H = 1024, A = 16;
  for (int64_t S : {128, 512}) {
    const double SH = S * H, AS2 = A * S * S;
    // The bytes a bert-large layer keeps in fp32, by count of its saved tensors: eager 66 SH + 9 A S^2; tempo (bit
    // masks) 40.75 SH + 4.125 A S^2; tempo with fused attention 40.75 SH + 4 A S (log-sum-exp) + the seed.
    const double expect_eager = 66 * SH + 9 * AS2;
    const double expect_tempo = 40.75 * SH + 4.125 * AS2;
    const double expect_fused = 40.75 * SH + 16;  // + the 16-byte Philox state
    const double expect_ckpt = 4 * SH;            // the layer's input only
    const int64_t eager = layer_bytes("eager", S);
    const int64_t tempo_b = layer_bytes("tempo", S);
    const int64_t fused = layer_bytes("tempo-sdpa", S);
    const int64_t ckpt = layer_bytes("eager+ckpt", S);
    std::printf(
        "bert-large S=%lld per-layer bytes: eager %lld (model %.0f), tempo %lld (model %.0f), "
        "tempo-sdpa %lld (model %.0f), checkpoint %lld (model %.0f)\n",
        (long long)S, (long long)eager, expect_eager, (long long)tempo_b, expect_tempo, (long long)fused, expect_fused,
        (long long)ckpt, expect_ckpt);
    EXPECT_NEAR(eager / expect_eager, 1.0, 0.03) << S;
    EXPECT_NEAR(tempo_b / expect_tempo, 1.0, 0.03) << S;
    EXPECT_NEAR(fused / expect_fused, 1.0, 0.03) << S;
    EXPECT_NEAR(ckpt / expect_ckpt, 1.0, 0.03) << S;
  }
}

TEST(Models, DeprecatedMethodSpellingsParseAsTheGlossarysWithOneWarning) {
  // Each spelling an earlier version took gives the Method its glossary spelling gives, with a
  // warning that names the new spelling; the new spelling warns nothing.
  struct Catch : c10::WarningHandler {
    std::vector<std::string> msgs;
    void process(const c10::Warning& w) override { msgs.push_back(w.msg()); }
  } caught;
  c10::WarningUtils::WarningHandlerGuard guard(&caught);
  const std::pair<const char*, const char*> spellings[] = {{"checkpoint", "eager+ckpt"},
                                                           {"tempo+checkpoint", "tempo+ckpt"},
                                                           {"sdpa-checkpoint", "sdpa-ckpt"},
                                                           {"tempo+recompute", "tempo+recompute-attention"},
                                                           {"eager+gelu+mlp_up", "eager+gelu+recompute-up"},
                                                           {"tempo+mlp_gate_up+head", "tempo+recompute-gate_up+head"}};
  for (const auto& [old, now] : spellings) {
    caught.msgs.clear();
    const Method a = Method::parse(old);
    ASSERT_EQ(caught.msgs.size(), 1u) << old;
    EXPECT_NE(caught.msgs[0].find("deprecated"), std::string::npos) << caught.msgs[0];
    caught.msgs.clear();
    const Method b = Method::parse(now);
    EXPECT_TRUE(caught.msgs.empty()) << now;
    EXPECT_EQ(a.attention, b.attention) << old;
    EXPECT_EQ(a.inplace_gelu, b.inplace_gelu) << old;
    EXPECT_EQ(a.inplace_norm, b.inplace_norm) << old;
    EXPECT_EQ(a.bit_dropout, b.bit_dropout) << old;
    EXPECT_EQ(a.checkpoint, b.checkpoint) << old;
    EXPECT_EQ(a.fused_head, b.fused_head) << old;
    EXPECT_EQ(a.fused_kernels, b.fused_kernels) << old;
    EXPECT_EQ(a.recompute_attention, b.recompute_attention) << old;
    EXPECT_EQ(a.mlp_recompute, b.mlp_recompute) << old;
  }
  EXPECT_TRUE(Method::parse("eager+ckpt").checkpoint);
  EXPECT_TRUE(Method::parse("tempo+recompute-attention").recompute_attention);
  EXPECT_EQ(Method::parse("tempo+recompute-gate_up").mlp_recompute, "gate_up");
  EXPECT_THROW(Method::parse("tempo+recompute-nothing"), c10::Error);
  EXPECT_THROW(Method::parse("method"), c10::Error);
}

TEST(Models, SwiGLUUnderTempoKeepsGateAndUpOrFewer) {
  // The gated MLP ("eager+gelu": tempo::gated_mlp) on a llama-small layer: of the four
  // intermediate-wide tensors eager keeps (gate, SiLU(gate), up, their product: I S fp32 values
  // each), two, and the layer's output as eager's within fp32 rounding; "+recompute-up" /
  // "+recompute-gate_up" one / none, with "eager+gelu"'s gradients (the backward recomputes up(x), gate(x)).
  tempo::memory::track_cpu();
  const c10::Device cpu(c10::kCPU);
  ModelConfig c = ModelConfig::preset("llama-small");
  c.layers = 1;
  c.vocab = 512;
  const int64_t S = 64;
  const char* methods[4] = {"eager+gelu", "eager+gelu+recompute-up", "eager+gelu+recompute-gate_up", "eager"};
  int64_t held[4];
  at::Tensor outs[4];
  std::vector<at::Tensor> grads[4];
  for (int k = 0; k < 4; ++k) {
    torch::manual_seed(0);
    auto m = tempo::models::make_model(c, Method::parse(methods[k]));
    EXPECT_EQ(Method::parse(methods[k]).mlp_recompute, k == 1 ? "up" : k == 2 ? "gate_up" : "product");
    const at::Tensor ids = at::randint(2, c.vocab, {1, S}, at::kLong);
    {
      tempo::memory::Scope scope(cpu);
      outs[k] = m->hidden_states(ids, at::Tensor());
      held[k] = scope.held() - outs[k].nbytes();
    }
    outs[k].square().sum().backward();
    for (auto& p : m->parameters())
      if (p.grad().defined()) grads[k].push_back(p.grad().clone());
  }
  const int64_t n = c.intermediate * S;
  EXPECT_EQ(held[3] - held[0], 2 * n * 4);
  EXPECT_LT((outs[0] - outs[3]).abs().max().item<double>(), 1e-4 * outs[3].abs().max().item<double>());
  EXPECT_EQ(held[0] - held[1], n * 4);
  EXPECT_EQ(held[0] - held[2], 2 * n * 4);
  for (int k = 1; k < 3; ++k) {
    ASSERT_EQ(grads[k].size(), grads[0].size());
    for (size_t i = 0; i < grads[0].size(); ++i)
      EXPECT_LT((grads[k][i] - grads[0][i]).abs().max().item<double>(),
                1e-4 * grads[0][i].abs().max().item<double>() + 1e-7)
          << methods[k] << " " << i;
  }
  EXPECT_THROW(Method::parse("eager+mlp_down"), c10::Error);
}

TEST(Models, GatedMLPModuleMatchesTheComposition) {
  // tempo::nn::GatedMLP (separate and fused projections, every activation, each recompute
  // option) against the torch composition in float64: output and every parameter's gradient.
  for (const char* act : {"silu", "gelu", "gelu_tanh"}) {
    for (bool fused : {false, true}) {
      for (const char* recompute : {"product", "up", "gate_up"}) {
        torch::manual_seed(1);
        tempo::nn::GatedMLP m(
            tempo::nn::GatedMLPOptions(24, 40).activation(act).bias(true).fused(fused).chunk(16).recompute(recompute));
        m->to(at::kDouble);
        const at::Tensor x = at::randn({3, 5, 24}, at::kDouble);
        const at::Tensor y = m->forward(x);
        const torch::nn::Linear& gp = fused ? m->gate_up_proj : m->gate_proj;
        auto grads_of = [&](const at::Tensor& out) {
          for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
          out.square().sum().backward();
          std::vector<at::Tensor> g;
          for (auto& p : m->parameters()) g.push_back(p.grad().clone());
          return g;
        };
        const auto ours = grads_of(y);
        at::Tensor g, u;
        if (fused) {
          auto parts = at::linear(x, gp->weight, gp->bias).chunk(2, -1);
          g = parts[0], u = parts[1];
        } else {
          g = at::linear(x, gp->weight, gp->bias), u = at::linear(x, m->up_proj->weight, m->up_proj->bias);
        }
        const std::string a(act);
        const at::Tensor f = a == "silu" ? at::silu(g) : at::gelu(g, a == "gelu" ? "none" : "tanh");
        const at::Tensor ref = at::linear(f * u, m->down_proj->weight, m->down_proj->bias);
        EXPECT_LT((y - ref).abs().max().item<double>(), 1e-12) << act << " fused " << fused;
        const auto theirs = grads_of(ref);
        for (size_t i = 0; i < ours.size(); ++i)
          EXPECT_LT((ours[i] - theirs[i]).abs().max().item<double>(), 1e-11)
              << act << " fused " << fused << " " << recompute << " " << i;
      }
    }
  }
  EXPECT_THROW(tempo::nn::GatedMLP(tempo::nn::GatedMLPOptions(8, 16).recompute("down")), c10::Error);
}

TEST(Models, BadConfigGivesClearErrors) {
  ModelConfig c = ModelConfig::preset("bert-base");
  c.hidden = 100;
  EXPECT_THROW(c.validate(), c10::Error);
  try {
    c.validate();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be divisible by heads"), std::string::npos);
  }
  c = ModelConfig::preset("bert-base");
  c.layers = 0;
  EXPECT_THROW(tempo::models::make_model(c, Method::parse("eager")), c10::Error);
  EXPECT_THROW(ModelConfig::preset("bert-huge"), c10::Error);
  EXPECT_THROW(Method::parse("fast"), c10::Error);
  EXPECT_THROW(Method::parse("tempo+magic"), c10::Error);
  const Method p = Method::parse("tempo-sdpa-norm");
  EXPECT_EQ(p.attention, "fused");
  EXPECT_FALSE(p.inplace_norm);
  EXPECT_TRUE(p.inplace_gelu && p.bit_dropout);
  const Method q = Method::parse("eager+gelu");
  EXPECT_TRUE(q.inplace_gelu && !q.inplace_norm && !q.bit_dropout && q.attention == "eager");
}

TEST(Models, MethodsAreSpelledAsTempoMethodsSpellsThem) {
  // tempo's attention is "auto" as in Python's tempo.methods (the one that keeps fewer bytes);
  // the Tempo paper's attention is the change "attention".
  EXPECT_EQ(Method::parse("tempo").attention, "auto");
  EXPECT_EQ(Method::parse("tempo+attention").attention, "tempo");
  EXPECT_EQ(Method::parse("tempo-sdpa").attention, "fused");
  EXPECT_EQ(Method::parse("tempo-fused").attention, "tempo");
  const Method r = Method::parse("tempo+recompute-gate_up+ckpt");
  EXPECT_TRUE(r.checkpoint && r.mlp_recompute == "gate_up" && r.fused_head);
  // The parts and recipes of a transformers model are refused by name, with why.
  const std::pair<const char*, const char*> refused[] = {{"trl", "TRL's recipe"},
                                                         {"hf-offload", "transformers' recipe"},
                                                         {"tempo+ckpt-offload", "the part 'ckpt-offload'"},
                                                         {"sdpa+ckpt+trl-head", "the part 'trl-head'"},
                                                         {"sdpa+torch-lce", "PyTorch's chunked loss"},
                                                         {"sdpa+compile-mem0.5", "torch.compile is Python's"},
                                                         {"tempo+offload", "keep what they save on the device"}};
  for (const auto& [spec, why] : refused) {
    try {
      Method::parse(spec);
      ADD_FAILURE() << spec << " was taken";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << spec << ": " << e.what();
    }
  }
}

TEST(Models, ParameterCountIsTheBuiltModels) {
  for (const std::string arch : {"bert", "roberta", "gpt2", "llama"}) {
    ModelConfig c = ModelConfig::for_arch(tempo::models::parse_arch(arch));
    c.resize(/*hidden=*/48, /*layers=*/3, /*heads=*/4, /*intermediate=*/80, /*positions=*/40, /*vocab=*/97);
    c.num_labels = 5;
    for (const std::string method : {"eager", "tempo-fused"}) {
      auto m = tempo::models::make_model(c, Method::parse(method));
      int64_t n = 0;
      for (const auto& p : m->parameters()) n += p.numel();
      EXPECT_EQ(c.parameter_count(), n) << arch << " " << method;
    }
  }
}

TEST(Models, AModelTheHostCannotHoldIsRefusedBeforeAllocating) {
  const auto avail = tempo::memory::host_available();
  ASSERT_TRUE(avail.has_value());  // Linux: /proc/meminfo
  EXPECT_GT(*avail, 0);
  ModelConfig c = ModelConfig::preset("bert-base");
  c.layers = 1000000;  // ~7e13 parameters: past any host here, refused before the first allocation
  try {
    tempo::models::make_model(c, Method::parse("tempo"));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("TransformerModel: bert-base (1000000 layers, hidden 768, " +
                        std::to_string(c.parameter_count()) + " parameters) needs "),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("this host can still allocate"), std::string::npos) << what;
  }
  c.layers = 1LL << 50;  // absurd sizes are an invalid config, not an overflow
  EXPECT_THROW(c.validate(), c10::Error);
  EXPECT_EQ(tempo::memory::format_bytes(512), "512 B");
  EXPECT_EQ(tempo::memory::format_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
  EXPECT_EQ(tempo::memory::format_bytes(int64_t{11} << 40), "11.00 TiB");
}

}  // namespace

namespace {

// Losses of `steps` AdamW steps on one fixed batch, from one seed.
std::vector<double> trajectory(const ModelConfig& c, const std::string& method, int steps, const Batch& batch,
                               bool train_mode) {
  torch::manual_seed(0);
  auto m = tempo::models::make_model(c, Method::parse(method));
  if (train_mode)
    m->train();
  else
    m->eval();
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  std::vector<double> losses;
  torch::manual_seed(1);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    at::Tensor loss = m->loss(batch);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

TEST(Models, StepZeroLossIsTheSameUnderEveryMethod) {
  for (const char* preset : {"bert-base", "roberta-base", "gpt2", "llama-small"}) {
    ModelConfig c = reduced(preset, 2, 1024);
    c.hidden = 128;
    c.heads = 4;
    c.intermediate = 512;
    const Batch batch = tempo::models::synthetic_batch(c, 8, 32, 3);
    // Dropout off (eval): the methods change what is kept, not what is computed.
    const double eager = trajectory(c, "eager", 1, batch, false)[0];
    EXPECT_EQ(trajectory(c, "eager+ckpt", 1, batch, false)[0], eager) << preset;
    for (const char* p : {"sdpa", "tempo", "tempo-sdpa", "tempo-fused"})
      EXPECT_NEAR(trajectory(c, p, 1, batch, false)[0], eager, 1e-5 * eager) << preset << " " << p;
  }
}

// The tempo methods compute the LM head and its loss with tempo::linear_cross_entropy: the
// same loss and gradients, without the log-softmax of the logits kept for backward.
TEST(Models, FusedHeadKeepsNoLogitsAndGivesTheSameGradients) {
  tempo::memory::track_cpu();
  for (const char* preset : {"gpt2", "bert-base", "llama-small"}) {
    ModelConfig c = reduced(preset, 1, 4096);
    c.hidden = 64, c.heads = 4, c.intermediate = 128;
    c.dropout = c.attention_dropout = 0.0;
    const int64_t B = 2, S = 64;
    const Batch batch = tempo::models::synthetic_batch(c, B, S, 5);
    Step st[2];
    const char* methods[2] = {"tempo-head", "tempo"};
    for (int i = 0; i < 2; ++i) {
      torch::manual_seed(0);
      auto m = tempo::models::make_model(c, Method::parse(methods[i]));
      st[i] = one_step(m, batch);
    }
    const double loss[2] = {st[0].loss, st[1].loss};
    const int64_t held[2] = {st[0].held, st[1].held};
    const std::vector<at::Tensor> grads[2] = {st[0].grads, st[1].grads};
    EXPECT_NEAR(loss[1], loss[0], 1e-5 * loss[0]) << preset;
    for (size_t k = 0; k < grads[0].size(); ++k)
      EXPECT_TRUE(at::allclose(grads[1][k], grads[0][k], 1e-4, 1e-6)) << preset << " parameter " << k;
    // The rows predicted: every next token (decoders), the labelled positions (BERT).
    const int64_t rows = std::string(preset) == "bert-base" ? batch.labels.ne(-100).sum().item<int64_t>()
                                                            : batch.attention_mask.slice(1, 1).sum().item<int64_t>();
    // Eager keeps the log-softmax of the logits (rows x V floats); the fused head one float
    // (the log-sum-exp) per row instead.
    EXPECT_GE(held[0] - held[1], rows * (c.vocab - 1) * 4 - 64) << preset << ": " << held[0] << " vs " << held[1];
  }
}

// tempo-fused (tempo with the Data Movement paper's fused layer kernels: qkv_split, bias +
// GELU, the projections' biases inside bias-dropout-residual-LayerNorm, the bias gradients
// summed in those passes) equals tempo: the same masks (same seed), the same loss and
// gradients within fp32 tolerance, at BERT-base and BERT-large layer shapes, an odd shape
// (hidden 36, 3 heads of 12, FFN 100, 13 tokens), GPT-2's (pre-LN: only the q/k/v split and
// bias + GELU apply); and it keeps no more than tempo.
TEST(Models, TempoFusedEqualsTempoForwardAndBackward) {
  tempo::memory::track_cpu();
  struct Case {
    const char* preset;
    int64_t hidden, heads, intermediate, batch, seq;
  };
  for (const Case& k : {Case{"bert-base", 768, 12, 3072, 2, 64}, Case{"bert-large", 1024, 16, 4096, 1, 48},
                        Case{"bert-base", 36, 3, 100, 3, 13}, Case{"gpt2", 768, 12, 3072, 2, 40}}) {
    ModelConfig c = reduced(k.preset, 1, 512);
    c.hidden = k.hidden, c.heads = k.heads, c.intermediate = k.intermediate;
    const Batch batch = tempo::models::synthetic_batch(c, k.batch, k.seq, 9);
    Step st[2];
    const char* methods[2] = {"tempo", "tempo-fused"};
    for (int i = 0; i < 2; ++i) {
      torch::manual_seed(0);
      auto m = tempo::models::make_model(c, Method::parse(methods[i]));
      m->train();
      {  // non-zero biases, so that a bias added twice or dropped shows
        at::NoGradGuard no_grad;
        for (auto& p : m->named_parameters())
          if (p.key().find("bias") != std::string::npos) p.value().uniform_(-0.5, 0.5);
      }
      torch::manual_seed(1);
      st[i] = one_step(m, batch);
    }
    const double loss[2] = {st[0].loss, st[1].loss};
    const int64_t held[2] = {st[0].held, st[1].held};
    const std::vector<at::Tensor> grads[2] = {st[0].grads, st[1].grads};
    const std::string what = std::string(k.preset) + " hidden " + std::to_string(k.hidden);
    EXPECT_NEAR(loss[1], loss[0], 2e-6 * loss[0]) << what;
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t j = 0; j < grads[0].size(); ++j) {
      const double ref = grads[0][j].norm().item<double>();
      const double diff = (grads[1][j] - grads[0][j]).norm().item<double>();
      EXPECT_LE(diff, 1e-5 * ref + 1e-9) << what << " parameter " << j << ": " << diff << " vs " << ref;
    }
    EXPECT_LE(held[1], held[0]) << what;
  }
}

// +recompute-attention: each layer keeps x instead of q, k, v (and the core's kept tensors), the backward
// reruns the projection and the attention core with the generator replayed: the same loss and
// gradients (dropout on), and q, k, v's bytes (3 B S H floats per layer) fewer held, under
// the fused attention backend, tempo's and tempo-fused.
TEST(Models, RecomputedAttentionGivesTheSameGradientsAndKeepsLess) {
  tempo::memory::track_cpu();
  for (const char* base : {"tempo-sdpa", "tempo", "tempo-fused"}) {
    ModelConfig c = reduced("bert-base", 2, 512);
    c.hidden = 96, c.heads = 4, c.intermediate = 192;
    const int64_t B = 2, S = 40;
    const Batch batch = tempo::models::synthetic_batch(c, B, S, 4);
    Step st[2];
    const std::string methods[2] = {base, std::string(base) + "+recompute-attention"};
    for (int i = 0; i < 2; ++i) {
      torch::manual_seed(0);
      auto m = tempo::models::make_model(c, Method::parse(methods[i]));
      m->train();
      torch::manual_seed(1);
      st[i] = one_step(m, batch);
    }
    EXPECT_NEAR(st[1].loss, st[0].loss, 1e-6 * st[0].loss) << base;
    for (size_t j = 0; j < st[0].grads.size(); ++j) {
      const double ref = st[0].grads[j].norm().item<double>();
      EXPECT_LE((st[1].grads[j] - st[0].grads[j]).norm().item<double>(), 1e-5 * ref + 1e-9) << base << " " << j;
    }
    // (less the generator state the checkpoint keeps per layer: a few KiB)
    EXPECT_GE(st[0].held - st[1].held, c.layers * (3 * B * S * c.hidden * 4 - 8192)) << base;
  }
}

TEST(Models, FiftyStepsOfEagerAndTempoAgreeWithinHalfAPercent) {
  // bert-base and gpt2 at all-MiniLM-L6-v2's widths (hidden 384, 12 heads, FFN 1536) with 2
  // layers and a 4096-token vocabulary, dropout on, a fresh batch each step. The baseline draws
  // the same dropout masks as tempo (tempo::nn::baseline_dropout), so the curves differ only by
  // what each keeps.
  const OneThread one;
  for (const char* preset : {"bert-base", "gpt2"}) {
    ModelConfig c = reduced(preset, 2);
    c.hidden = 384, c.intermediate = 1536;
    std::vector<double> curves[2];
    const char* methods[2] = {"eager", "tempo"};
    for (int k = 0; k < 2; ++k) {
      torch::manual_seed(0);
      auto m = tempo::models::make_model(c, Method::parse(methods[k]));
      m->train();
      torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
      torch::manual_seed(1);
      for (int s = 0; s < 50; ++s) {
        const Batch batch = tempo::models::synthetic_batch(c, 2, 64, 100 + s);
        opt.zero_grad();
        at::Tensor loss = m->loss(batch);
        loss.backward();
        opt.step();
        curves[k].push_back(loss.item<double>());
      }
    }
    double worst = 0;
    for (size_t s = 0; s < curves[0].size(); ++s)
      worst = std::max(worst, std::fabs(curves[1][s] - curves[0][s]) / curves[0][s]);
    std::printf("%s: loss %.4f -> %.4f (eager), %.4f -> %.4f (tempo), largest step difference %.2e\n", preset,
                curves[0].front(), curves[0].back(), curves[1].front(), curves[1].back(), worst);
    EXPECT_LT(worst, 0.005) << preset;
  }
}

// Mixed precision: 30 training steps (dropout on, AdamW, a fresh batch each step) of eager and
// tempo under CPU autocast (bf16) and with the model in pure bf16, against eager in fp32. The
// bound: tempo's curve stays as close to eager's in the same precision as bf16 itself keeps
// eager to fp32 (twice that deviation, or 1%), i.e. tempo adds no error of its own beyond
// bf16's rounding. The table printed here is the one in docs/accuracy.md.
std::vector<double> mixed_curve(const ModelConfig& c, const std::string& method, const std::string& mode) {
  torch::manual_seed(0);
  auto m = tempo::models::make_model(c, Method::parse(method));
  m->train();
  if (mode == "bf16") m->to(at::kBFloat16);
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  std::vector<double> losses;
  torch::manual_seed(1);
  for (int s = 0; s < 30; ++s) {
    const Batch batch = tempo::models::synthetic_batch(c, 4, 64, 200 + s);
    opt.zero_grad();
    at::Tensor loss;
    if (mode == "autocast") {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      loss = m->loss(batch);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    } else {
      loss = m->loss(batch);
    }
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

double worst_rel(const std::vector<double>& a, const std::vector<double>& ref) {
  double w = 0;
  for (size_t i = 0; i < a.size(); ++i) w = std::max(w, std::fabs(a[i] - ref[i]) / std::fabs(ref[i]));
  return w;
}

TEST(Models, MixedPrecisionTempoStaysWithinBf16sOwnDeviation) {
  const OneThread one;
  for (const char* preset : {"bert-base", "gpt2"}) {
    ModelConfig c = reduced(preset, 2, 1024);
    c.hidden = 128, c.heads = 4, c.intermediate = 512;
    const std::vector<double> ref = mixed_curve(c, "eager", "fp32");
    for (const char* mode : {"autocast", "bf16"}) {
      const auto eager = mixed_curve(c, "eager", mode);
      const double own = worst_rel(eager, ref);
      for (const char* method : {"tempo", "tempo-fused"}) {
        const auto t = mixed_curve(c, method, mode);
        const double dev = worst_rel(t, eager);
        std::printf("| %s | %s | %s | %.4f -> %.4f | %.2e | %.2e | %.2e |\n", preset, mode, method, t.front(), t.back(),
                    dev, own, worst_rel(t, ref));
        EXPECT_LE(dev, std::max(2 * own, 0.01)) << preset << " " << mode << " " << method;
      }
    }
  }
}

// No leak under load: 1500 small training steps (dropout on, AdamW) per method and model
// family; after a warm-up the bytes held between steps (the tracker's exact count) never grow,
// so no saved tensor, mask or bit buffer outlives its step.
TEST(Models, HeldBytesDoNotGrowOverManySteps) {
  const OneThread one;  // 15000 steps of tiny models gain nothing from more
  tempo::memory::track_cpu();
  const c10::Device cpu(c10::kCPU);
  for (const char* preset : {"bert-base", "llama-small"}) {
    ModelConfig c = reduced(preset, 1, 256);
    c.hidden = 32;
    c.heads = 2;
    c.intermediate = 64;
    for (const char* method : {"eager", "eager+ckpt", "sdpa", "tempo", "tempo-sdpa"}) {
      torch::manual_seed(0);
      auto m = tempo::models::make_model(c, Method::parse(method));
      m->train();
      torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3));
      int64_t settled = -1, worst = 0;
      for (int s = 0; s < 1500; ++s) {
        const Batch batch = tempo::models::synthetic_batch(c, 2, 16, 1000 + s);
        opt.zero_grad(/*set_to_none=*/true);
        at::Tensor loss = m->loss(batch);
        loss.backward();
        opt.step();
        loss.reset();
        const int64_t held = tempo::memory::stats(cpu).current;
        if (s == 20) settled = held;  // weights, gradients and AdamW state all exist by now
        if (s > 20) worst = std::max(worst, held - settled);
      }
      EXPECT_LE(worst, 0) << preset << " " << method << ": held bytes grew by " << worst << " over 1500 steps";
    }
  }
}

// ---- the checked file writer ----------------------------------------------------------------

std::string contents(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(FileWrite, AFailedWriteRaisesWithTheReasonAndLeavesTheOldFile) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("tempo_file_write_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path file = dir / "a.txt";
  tempo::models::write_file_atomically(file.string(), "old", "test");
  EXPECT_EQ(contents(file), "old");
  {  // not committed (an exception on the way): the old content stays, no temporary file
    tempo::models::AtomicFile f(file.string(), "test");
    f.write("new and longer");
  }
  EXPECT_EQ(contents(file), "old");
  EXPECT_FALSE(fs::exists(dir / "a.txt.tmp"));
  // a full disk: /dev/full, directly and through a link (written in place; the link is kept)
  std::string why = error_of([] { tempo::models::write_file_atomically("/dev/full", "x", "test op"); });
  EXPECT_NE(why.find("test op: writing /dev/full failed: No space left on device"), std::string::npos) << why;
  fs::create_symlink("/dev/full", dir / "full");
  why = error_of([&] { tempo::models::write_file_atomically((dir / "full").string(), "x", "test op"); });
  EXPECT_NE(why.find("No space left on device"), std::string::npos) << why;
  EXPECT_TRUE(fs::is_symlink(dir / "full"));
  why = error_of([&] { tempo::models::append_to_file((dir / "full").string(), "row\n", "test op"); });
  EXPECT_NE(why.find("No space left on device"), std::string::npos) << why;
  // a folder that does not exist
  why = error_of([&] { tempo::models::write_safetensors((dir / "no" / "m.safetensors").string(), {}); });
  EXPECT_NE(why.find("tempo::models::write_safetensors: writing"), std::string::npos) << why;
  EXPECT_NE(why.find("No such file or directory"), std::string::npos) << why;
  // a link to a file: the file it names is replaced, the link stays a link
  fs::create_symlink("a.txt", dir / "link.txt");
  tempo::models::write_file_atomically((dir / "link.txt").string(), "through the link", "test");
  EXPECT_TRUE(fs::is_symlink(dir / "link.txt"));
  EXPECT_EQ(contents(file), "through the link");
  // appends, and a safetensors file read back as written
  tempo::models::append_to_file((dir / "log").string(), "a\n", "test");
  tempo::models::append_to_file((dir / "log").string(), "b\n", "test");
  EXPECT_EQ(contents(dir / "log"), "a\nb\n");
  const at::Tensor t = at::arange(10, at::kFloat).reshape({2, 5}).t();  // not contiguous
  tempo::models::write_safetensors((dir / "t.safetensors").string(), {{"t", t}});
  EXPECT_TRUE(at::equal(tempo::models::read_safetensors((dir / "t.safetensors").string()).at("t"), t));
  fs::remove_all(dir);
}

}  // namespace
