// LibTorch-level tests of tempo::attention and tempo::nn::SelfAttention: values and
// gradients against ATen's eager attention in float64, dropout against the forward's bits,
// the module's backends against each other, and errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "tempo/models.h"

namespace {

at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep_mask,
                     bool causal, const at::Tensor& drop_keep = {}, double p = 0.0) {
  auto s = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  s = s.masked_fill(keep_mask.logical_not(), -INFINITY);
  if (causal) s = s.masked_fill(at::ones({q.size(2), k.size(2)}, at::kBool).triu(1), -INFINITY);
  auto P = at::softmax(s, -1);
  if (drop_keep.defined()) P = P * drop_keep / (1 - p);
  return at::matmul(P, v);
}

TEST(AttentionTorch, MatchesEagerFloat64WithMasks) {
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto q = torch::randn({2, 3, 13, 16}, opts).requires_grad_();
  auto k = torch::randn({2, 3, 13, 16}, opts).requires_grad_();
  auto v = torch::randn({2, 3, 13, 16}, opts).requires_grad_();
  auto mask = torch::ones({2, 1, 1, 13}, torch::kBool);
  mask.index_put_({1, torch::indexing::Ellipsis, torch::indexing::Slice(9)}, false);
  auto w = torch::randn({2, 3, 13, 16}, opts);
  for (bool causal : {false, true}) {
    auto o1 = tempo::attention(q, k, v, mask, 0.0, causal);
    auto o2 = reference(q, k, v, mask, causal);
    EXPECT_TRUE(torch::allclose(o1, o2, 1e-12, 1e-12));
    auto g1 = torch::autograd::grad({(o1 * w).sum()}, {q, k, v});
    auto g2 = torch::autograd::grad({(o2 * w).sum()}, {q, k, v});
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::allclose(g1[i], g2[i], 1e-10, 1e-10)) << i;
  }
}

TEST(AttentionTorch, DropoutUsesTheForwardBits) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto q = torch::randn({1, 2, 9, 8}, opts).requires_grad_();
  const double p = 0.25;
  torch::manual_seed(7);
  auto [out, P, bits] =
      tempo::attention_forward(q.detach(), q.detach(), q.detach(), std::nullopt, p, false, std::nullopt, "bits");
  auto shifts = torch::arange(8, torch::kUInt8);
  auto keep =
      bits.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(1).flatten().slice(0, 0, P.numel()).view(P.sizes());
  torch::manual_seed(7);
  auto o1 = tempo::attention(q, q, q, std::nullopt, p);
  auto o2 = reference(q, q, q, torch::ones({1}, torch::kBool), false, keep.to(torch::kFloat64), p);
  EXPECT_TRUE(torch::allclose(o1, o2, 1e-12, 1e-12));
  auto g1 = torch::autograd::grad({o1.sum()}, {q});
  auto g2 = torch::autograd::grad({o2.sum()}, {q});
  EXPECT_TRUE(torch::allclose(g1[0], g2[0], 1e-10, 1e-10));
}

TEST(AttentionTorch, ModuleBackendsAgree) {
  torch::manual_seed(1);
  tempo::nn::SelfAttention ref(tempo::nn::SelfAttentionOptions(32, 4).backend("eager"));
  auto x = torch::randn({2, 7, 32});
  auto pad = torch::ones({2, 7}, torch::kLong);
  pad.index_put_({0, torch::indexing::Slice(5)}, 0);
  const auto expected = ref(x, pad);
  for (const char* backend : {"tempo", "sdpa", "auto"}) {
    tempo::nn::SelfAttention m(tempo::nn::SelfAttentionOptions(32, 4).backend(backend).causal(false));
    auto src = ref->named_parameters();
    for (auto& p : m->named_parameters()) {
      torch::NoGradGuard g;
      p.value().copy_(src[p.key()]);
    }
    EXPECT_TRUE(torch::allclose(m(x, pad), expected, 1e-5, 1e-5)) << backend;
  }
}

TEST(AttentionTorch, ErrorsNameOpAndArgument) {
  auto q = torch::randn({2, 3, 5, 8});
  try {
    tempo::attention(q, torch::randn({2, 3, 5, 4}), q);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tempo::attention: argument 'k' must have the head dim of q"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(tempo::nn::SelfAttention(tempo::nn::SelfAttentionOptions(30, 4)), c10::Error);
  EXPECT_THROW(tempo::nn::SelfAttention(tempo::nn::SelfAttentionOptions(32, 4).backend("flash")), c10::Error);
}

}  // namespace
