// PerformerLM and the SLiM chunked trainer from LibTorch: the model against a plain fp64
// re-computation from its weights, chunked forwards against one forward, chunked gradients
// against full backpropagation, and clear errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>

#include "tempo/models.h"

namespace {

using tempo::models::Method;
using tempo::models::PerformerConfig;
using tempo::models::PerformerLM;

PerformerConfig small(const std::string& feature_map = "sqr", int64_t max_len = 64) {
  PerformerConfig c;
  c.d_model = 24, c.layers = 2, c.ffn = 40, c.heads = 3, c.max_len = max_len, c.vocab = 50;
  c.feature_map = feature_map;
  return c;
}

PerformerLM make(const PerformerConfig& c, const std::string& method, at::ScalarType dtype, uint64_t seed = 0) {
  torch::manual_seed(seed);
  PerformerLM m(c, Method::parse(method));
  m->to(dtype);
  return m;
}

at::Tensor tokens_of(int64_t batch, int64_t length, int64_t vocab, uint64_t seed = 1) {
  torch::manual_seed(seed);
  return at::randint(0, vocab, {batch, length}, at::kLong);
}

// The model's logits recomputed with plain ATen ops in fp64 from its weights: sinusoidal
// positions from their formula, causal linear attention as an explicit prefix sum over
// positions (y_l = sum_{j<=l} (q_l . k_j) v_j / (sum_{j<=l} q_l . k_j + eps)).
at::Tensor reference_logits(PerformerLM& m, const at::Tensor& tokens) {
  const auto& c = m->config();
  auto w = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
  const int64_t B = tokens.size(0), L = tokens.size(1), A = c.heads, d = c.d_model / A;
  at::Tensor pe = at::zeros({L, c.d_model}, at::kDouble);
  for (int64_t p = 0; p < L; ++p)
    for (int64_t i = 0; i < c.d_model; ++i) {
      const double angle = p / std::pow(10000.0, static_cast<double>(i - i % 2) / c.d_model);
      pe[p][i] = i % 2 ? std::cos(angle) : std::sin(angle);
    }
  at::Tensor x = w(m->embed->weight).index_select(0, tokens.flatten()).view({B, L, c.d_model}) + pe;
  auto ln = [&](const at::Tensor& t, const tempo::nn::LayerNorm& n) {
    return at::layer_norm(t, {c.d_model}, w(n->weight), w(n->bias), c.norm_eps);
  };
  auto lin = [&](const at::Tensor& t, const torch::nn::Linear& l) { return at::linear(t, w(l->weight), w(l->bias)); };
  for (size_t r = 0; r < m->blocks->size(); ++r) {
    auto* b = m->blocks[r]->as<tempo::models::PerformerBlockImpl>();
    const at::Tensor qkv = lin(ln(x, b->ln1), b->attn->qkv).view({B, L, 3, A, d}).permute({2, 0, 3, 1, 4});
    const at::Tensor q = qkv[0] * qkv[0], k = qkv[1] * qkv[1], v = qkv[2];  // sqr features
    at::Tensor y = at::zeros_like(v);
    at::Tensor num = at::zeros({B, A, d, d}, at::kDouble), den = at::zeros({B, A, d}, at::kDouble);
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor kl = k.select(2, l), vl = v.select(2, l), ql = q.select(2, l);
      num = num + kl.unsqueeze(-1) * vl.unsqueeze(-2);
      den = den + kl;
      y.select(2, l).copy_(at::matmul(ql.unsqueeze(-2), num).squeeze(-2) /
                           ((ql * den).sum(-1, true) + b->attn->options.eps()));
    }
    x = x + lin(y.transpose(1, 2).reshape({B, L, c.d_model}), b->attn->out);
    x = x + lin(at::gelu(lin(ln(x, b->ln2), b->fc1)), b->fc2);
  }
  return lin(ln(x, m->ln), m->head);
}

TEST(PerformerLM, MatchesAPlainFp64RecomputationUnderEachMethod) {
  for (const char* method : {"eager", "tempo"}) {
    PerformerLM m = make(small(), method, at::kDouble);
    const at::Tensor t = tokens_of(2, 37, 50);
    const at::Tensor ref = reference_logits(m, t);
    EXPECT_TRUE(at::allclose(m->forward(t), ref, 1e-10, 1e-10)) << method;
    PerformerLM f = make(small(), method, at::kFloat);
    EXPECT_TRUE(at::allclose(f->forward(t).to(at::kDouble), ref, 1e-4, 1e-4)) << method;
  }
}

TEST(PerformerLM, ChunksWithCarriedStatesGiveTheWholeSequencesLogits) {
  for (const char* fm : {"sqr", "relu", "elu", "favor"}) {
    PerformerLM m = make(small(fm), "tempo", at::kDouble);
    const at::Tensor t = tokens_of(2, 41, 50);
    const at::Tensor whole = m->forward(t);
    tempo::models::LayerStates states;
    std::vector<at::Tensor> parts;
    for (int64_t s = 0; s < 41; s += 6) {
      auto [logits, next] = m->forward_chunk(t.narrow(1, s, std::min<int64_t>(6, 41 - s)), s, states);
      parts.push_back(logits);
      states = next;
    }
    EXPECT_TRUE(at::allclose(at::cat(parts, 1), whole, 1e-10, 1e-10)) << fm;
  }
}

double loss_tol(at::ScalarType t) { return t == at::kDouble ? 1e-12 : 1e-6; }

TEST(Slim, ChunkedGradientsEqualFullBackpropagation) {
  struct Case {
    int64_t length;
    std::optional<int64_t> chunk;
  };
  // C = 1, C not dividing L, C = L, C > L, one chunk (none).
  const Case cases[] = {{13, 1}, {34, 5}, {33, 32}, {33, 100}, {25, std::nullopt}, {64, 16}};
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const double bound = dtype == at::kDouble ? 1e-10 : 1e-5;
    for (const auto& k : cases) {
      PerformerLM m = make(small(), "tempo", dtype);
      const at::Tensor t = tokens_of(2, k.length + 1, 50, k.length);
      const auto d = tempo::slim::gradient_discrepancy(m, t, k.chunk);
      EXPECT_LE(d.grad_rel, bound) << "L " << k.length << " C " << k.chunk.value_or(0) << " " << dtype;
      EXPECT_NEAR(d.chunked_loss, d.full_loss, loss_tol(dtype) * std::abs(d.full_loss));
      EXPECT_GT(d.full_loss, 0);
    }
  }
}

TEST(Slim, Bf16ChunkedGradientsAreAsCloseAsFullBackpropagations) {
  // Against fp32 full backpropagation from the same weights: the chunked gradients of a bf16
  // model within 1.5x full backpropagation's own bf16 error (measured 1.05x; summing the chunks'
  // gradients in bf16 grad() gave 6.8x at chunk 1).
  auto flat = [](PerformerLM& m) {
    std::vector<at::Tensor> g;
    for (const auto& p : m->parameters()) g.push_back(p.grad().flatten().to(at::kDouble));
    m->zero_grad();
    return at::cat(g);
  };
  const at::Tensor t = tokens_of(2, 129, 50);
  PerformerLM ref = make(small("sqr", 128), "tempo", at::kFloat);
  tempo::slim::full_loss_and_backward(ref, t);
  const at::Tensor want = flat(ref);
  auto err = [&](const at::Tensor& g) { return ((g - want).norm() / want.norm()).item<double>(); };
  PerformerLM m = make(small("sqr", 128), "tempo", at::kBFloat16);
  tempo::slim::full_loss_and_backward(m, t);
  const double full = err(flat(m));
  EXPECT_GT(full, 1e-4);  // bf16's own error: the comparison means something
  for (int64_t chunk : {1, 7, 64}) {
    tempo::slim::loss_and_backward(m, t, chunk);
    EXPECT_LE(err(flat(m)), 1.5 * full) << "chunk " << chunk;
  }
}

TEST(PerformerLM, ParameterCountIsTheBuiltModelsAndAHugeOneIsRefused) {
  for (const char* fm : {"relu", "favor"}) {
    PerformerConfig c = small(fm);
    c.features = std::string(fm) == "favor" ? 5 : 0;
    PerformerLM m = make(c, "tempo", at::kFloat);
    int64_t params = 0, buffers = 0;
    for (const auto& p : m->parameters()) params += p.numel();
    for (const auto& b : m->buffers()) buffers += b.numel();
    EXPECT_EQ(c.parameter_count(), params) << fm;
    EXPECT_EQ(c.buffer_count(), buffers) << fm;
  }
  PerformerConfig huge = small();
  huge.layers = 10000000, huge.d_model = 1024, huge.heads = 4, huge.ffn = 4096;  // ~1.3e14 parameters
  try {
    PerformerLM m(huge, Method::parse("tempo"));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("this host can still allocate"), std::string::npos) << e.what();
  }
  huge.layers = int64_t{1} << 50;
  EXPECT_THROW(huge.validate(), c10::Error);
}

TEST(Slim, EveryFeatureMapModeAndMethodAndAWeightedLoss) {
  for (const char* fm : {"relu", "elu", "favor"})
    for (const char* mode : {"iterative", "prefix"})
      for (const char* method : {"eager", "tempo"}) {
        PerformerConfig c = small(fm);
        c.mode = mode;
        PerformerLM m = make(c, method, at::kDouble);
        const at::Tensor t = tokens_of(2, 30, 50);
        at::Tensor weight = (at::arange(29, at::kDouble) >= 14).to(at::kDouble).expand({2, 29}).contiguous();
        const auto d = tempo::slim::gradient_discrepancy(m, t, 4, weight);
        EXPECT_LE(d.grad_rel, 1e-10) << fm << " " << mode << " " << method;
        EXPECT_NEAR(d.chunked_loss, d.full_loss, 1e-12 * std::abs(d.full_loss));
      }
}

TEST(Slim, InPlaceMethodsGiveTheEagerGradients) {
  PerformerLM e = make(small(), "eager", at::kDouble), t = make(small(), "tempo", at::kDouble);
  const at::Tensor tok = tokens_of(1, 40, 50);
  const double le = tempo::slim::loss_and_backward(e, tok, 7).item<double>();
  const double lt = tempo::slim::loss_and_backward(t, tok, 7).item<double>();
  EXPECT_NEAR(le, lt, 1e-12);
  const auto pe = e->parameters(), pt = t->parameters();
  ASSERT_EQ(pe.size(), pt.size());
  for (size_t i = 0; i < pe.size(); ++i) EXPECT_TRUE(at::allclose(pe[i].grad(), pt[i].grad(), 1e-9, 1e-11)) << i;
}

TEST(Slim, ClearErrors) {
  PerformerLM m = make(small(), "tempo", at::kFloat);
  const at::Tensor t = tokens_of(1, 20, 50);
  auto fails = [&](const at::Tensor& tokens, std::optional<int64_t> chunk, const std::string& message) {
    try {
      tempo::slim::loss_and_backward(m, tokens, chunk);
      ADD_FAILURE() << "no error; expected: " << message;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  fails(t, 0, "chunk must be positive");
  fails(t, -3, "chunk must be positive");
  fails(t.narrow(1, 0, 1), 4, "at least 2 tokens");
  fails(at::empty({1, 0}, at::kLong), 4, "at least 2 tokens");
  fails(at::empty({0, 10}, at::kLong), 4, "batch is empty");
  fails(t.clone().index_put_({0, 3}, 50), 4, "token ids must be in [0, 50)");
  fails(t.clone().index_put_({0, 3}, -1), 4, "token ids must be in [0, 50)");
  fails(t.to(at::kFloat), 4, "integer tensor");
  fails(tokens_of(1, 70, 50), 4, "exceed the model's max_len 64");
  // Weights that would give a NaN or a negative loss silently, through both entry points.
  for (double bad : {std::nan(""), -1.0, static_cast<double>(INFINITY)}) {
    const at::Tensor w = at::ones({1, 19}).index_put_({0, 5}, bad);
    for (int full = 0; full < 2; ++full) {
      try {
        if (full)
          tempo::slim::full_loss_and_backward(m, t, w);
        else
          tempo::slim::loss_and_backward(m, t, 4, w);
        ADD_FAILURE() << "no error for a weight of " << bad;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("loss_weight must be finite and >= 0"), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_THROW(PerformerLM(small(), Method::parse("eager+ckpt")), c10::Error);
  PerformerConfig bad = small();
  bad.heads = 5;
  EXPECT_THROW(PerformerLM(bad, Method::parse("tempo")), c10::Error);
  for (auto& p : m->parameters()) EXPECT_FALSE(p.grad().defined());  // nothing ran
}

TEST(Slim, PeakMemoryOfAChunkedStepDoesNotGrowWithTheLength) {
  tempo::memory::track_cpu();
  const c10::Device cpu(c10::kCPU);
  int64_t peaks[2];
  const int64_t lengths[2] = {256, 2048};
  for (int i = 0; i < 2; ++i) {
    PerformerLM m = make(small("sqr", lengths[i]), "tempo", at::kFloat);
    const at::Tensor t = tokens_of(1, lengths[i] + 1, 50);
    for (auto& p : m->parameters()) p.mutable_grad() = at::zeros_like(p);
    tempo::memory::Scope scope(cpu);
    tempo::slim::loss_and_backward(m, t, 32);
    peaks[i] = scope.peak();
  }
  // 8x the length: only the token tensors' slices and the loss weights grow (bytes per position).
  EXPECT_LT(peaks[1], peaks[0] * 1.10) << peaks[0] << " -> " << peaks[1];
}

}  // namespace
