// LibTorch-level tests of tempo's norms and dropout: C++ modules against torch::nn / ATen in
// float64 (values and autograd gradients), state-dict compatibility, the fused op from C++,
// and error messages.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tempo/tempo.h"

namespace {

std::vector<at::Tensor> grads(const at::Tensor& y, const at::Tensor& w, std::vector<at::Tensor> inputs) {
  return torch::autograd::grad({(y * w).sum()}, inputs);
}

TEST(NormTorch, LayerNormModuleMatchesTorch) {
  torch::manual_seed(0);
  torch::nn::LayerNorm ref(torch::nn::LayerNormOptions({24}).eps(1e-6));
  tempo::nn::LayerNorm ours(tempo::nn::LayerNormOptions({24}).eps(1e-6));
  ref->to(torch::kFloat64);
  ours->to(torch::kFloat64);
  {
    torch::NoGradGuard g;
    ref->weight.normal_(1, 0.3);
    ref->bias.normal_(0, 0.1);
  }
  // Same parameter names and shapes: copy torch's into ours by name.
  auto src = ref->named_parameters();
  for (auto& p : ours->named_parameters()) {
    torch::NoGradGuard g;
    p.value().copy_(src[p.key()]);
  }
  auto x = torch::randn({5, 7, 24}, torch::kFloat64).requires_grad_();
  auto w = torch::randn({5, 7, 24}, torch::kFloat64);
  auto y1 = ours(x), y2 = ref(x);
  EXPECT_TRUE(torch::allclose(y1, y2, 1e-12, 1e-12));
  auto g1 = grads(y1, w, {x, ours->weight, ours->bias});
  auto g2 = grads(y2, w, {x, ref->weight, ref->bias});
  for (size_t i = 0; i < g1.size(); ++i) EXPECT_TRUE(torch::allclose(g1[i], g2[i], 1e-10, 1e-10)) << i;
}

TEST(NormTorch, RMSNormModuleMatchesATen) {
  torch::manual_seed(1);
  tempo::nn::RMSNorm ours(tempo::nn::RMSNormOptions({16}).eps(1e-5));
  ours->to(torch::kFloat64);
  {
    torch::NoGradGuard g;
    ours->weight.normal_(1, 0.3);
  }
  auto x = torch::randn({9, 16}, torch::kFloat64).requires_grad_();
  auto gw = ours->weight.detach().clone().requires_grad_();
  auto w = torch::randn({9, 16}, torch::kFloat64);
  auto y1 = ours(x);
  auto y2 = at::rms_norm(x, {16}, gw, 1e-5);
  EXPECT_TRUE(torch::allclose(y1, y2, 1e-12, 1e-12));
  auto g1 = grads(y1, w, {x, ours->weight});
  auto g2 = grads(y2, w, {x, gw});
  for (size_t i = 0; i < g1.size(); ++i) EXPECT_TRUE(torch::allclose(g1[i], g2[i], 1e-10, 1e-10)) << i;
}

TEST(NormTorch, FusedOpFromCppMatchesUnfused) {
  torch::manual_seed(2);
  auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto x = torch::randn({6, 40}, opts).requires_grad_();
  auto bias = torch::randn({40}, opts).requires_grad_();
  auto res = torch::randn({6, 40}, opts).requires_grad_();
  auto gamma = (1 + 0.3 * torch::randn({40}, opts)).requires_grad_();
  auto beta = (0.1 * torch::randn({40}, opts)).requires_grad_();
  auto w = torch::randn({6, 40}, opts);
  torch::manual_seed(5);
  auto y1 = tempo::bias_dropout_add_layer_norm(x, bias, res, 0.2, gamma, beta, 1e-5, "philox");
  torch::manual_seed(5);
  auto h = res + tempo::dropout(x + bias, 0.2, true, "philox");
  auto y2 = at::layer_norm(h, {40}, gamma, beta, 1e-5);
  EXPECT_TRUE(torch::allclose(y1, y2, 1e-12, 1e-12));
  auto g1 = grads(y1, w, {x, bias, res, gamma, beta});
  auto g2 = grads(y2, w, {x, bias, res, gamma, beta});
  for (size_t i = 0; i < g1.size(); ++i) EXPECT_TRUE(torch::allclose(g1[i], g2[i], 1e-10, 1e-10)) << i;
}

TEST(DropoutTorch, ModuleTrainEvalAndSeeding) {
  tempo::nn::Dropout d(tempo::nn::DropoutOptions(0.5).mode("bits"));
  auto x = torch::randn({1000});
  d->eval();
  EXPECT_TRUE(d(x).is_same(x));
  d->train();
  torch::manual_seed(3);
  auto a = d(x);
  torch::manual_seed(3);
  auto b = tempo::dropout(x, 0.5, true, "philox");
  EXPECT_TRUE(torch::equal(a, b));
  const double kept = (a != 0).sum().item<double>();
  EXPECT_NEAR(kept, 500, 5 * std::sqrt(250.0));
}

TEST(NormDropoutTorch, ErrorsNameOpAndArgument) {
  auto x = torch::randn({4, 8});
  try {
    tempo::layer_norm(x, {8}, torch::ones({7}));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tempo::layer_norm: argument 'weight' must have shape [8]"), std::string::npos)
        << e.what();
  }
  try {
    tempo::nn::Dropout(tempo::nn::DropoutOptions(1.5));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tempo::dropout: argument 'p' must be a probability"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(tempo::dropout(x, 0.5, true, "bytes"), c10::Error);
}

}  // namespace
