// LibTorch-level tests of tempo's norms and dropout: C++ modules against torch::nn / ATen in
// float64 (values and autograd gradients), state-dict compatibility, the fused op from C++,
// and error messages.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tempo/models.h"

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

// Gammas of 0 and 1e-33 with betas that dwarf them, from C++: the kept columns make every
// gradient torch's (fp32 and fp64), and the second derivative is an error naming the op.
TEST(NormTorch, TinyGammasFromCppAreExact) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    torch::manual_seed(2);
    const int64_t M = 32;
    auto w = (1 + 0.3 * torch::randn({M}, torch::kFloat64));
    auto b = 0.1 * torch::randn({M}, torch::kFloat64);
    w[0] = 0.0;
    w[5] = 1e-33;
    b[5] = 1e-31;
    w[9] = -1e-6;
    b[9] = 3.0;
    w = w.to(dtype).requires_grad_();
    b = b.to(dtype).requires_grad_();
    const auto kept = tempo::norm_kept_columns(w.detach(), b.detach());
    EXPECT_EQ(kept.numel(), dtype == torch::kFloat64 ? 2 : 3);  // beta / gamma = 100: recovered in fp64 (R 1024)
    auto x = torch::randn({11, M}, dtype).requires_grad_();
    auto dy = torch::randn({11, M}, dtype);
    auto ours = grads(tempo::layer_norm(x, {M}, w, b), dy, {x, w, b});
    auto x64 = x.detach().to(torch::kFloat64).requires_grad_();
    auto w64 = w.detach().to(torch::kFloat64).requires_grad_();
    auto b64 = b.detach().to(torch::kFloat64).requires_grad_();
    auto ref = grads(at::layer_norm(x64, {M}, w64, b64), dy.to(torch::kFloat64), {x64, w64, b64});
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
    for (size_t i = 0; i < ours.size(); ++i) {
      const double err = ((ours[i].to(torch::kFloat64) - ref[i]).norm() / ref[i].norm()).item<double>();
      EXPECT_LT(err, tol) << "gradient " << i;
    }
  }
  auto x = torch::randn({4, 8}, torch::kFloat64).requires_grad_();
  auto y = tempo::layer_norm(x, {8}, torch::ones({8}, torch::kFloat64), torch::zeros({8}, torch::kFloat64));
  auto g = torch::autograd::grad({y.square().sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  try {
    g.sum().backward();
    FAIL() << "double backward did not raise";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tempo::layer_norm: double backward"), std::string::npos) << e.what();
  }
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
