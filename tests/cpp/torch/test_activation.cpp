// LibTorch-level tests of tempo::gelu / tempo::silu and their modules: values and autograd
// gradients against ATen's own ops in float64, bias gradients, error messages.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tempo/models.h"

namespace {

struct Case {
  const char* name;
  std::function<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&)> tempo, reference;
};

std::vector<Case> cases() {
  return {
      {"gelu", [](const at::Tensor& x, const std::optional<at::Tensor>& b) { return tempo::gelu(x, "none", b); },
       [](const at::Tensor& x, const std::optional<at::Tensor>& b) { return at::gelu(b ? x + *b : x); }},
      {"gelu_tanh", [](const at::Tensor& x, const std::optional<at::Tensor>& b) { return tempo::gelu(x, "tanh", b); },
       [](const at::Tensor& x, const std::optional<at::Tensor>& b) { return at::gelu(b ? x + *b : x, "tanh"); }},
      {"silu", [](const at::Tensor& x, const std::optional<at::Tensor>& b) { return tempo::silu(x, b); },
       [](const at::Tensor& x, const std::optional<at::Tensor>& b) { return at::silu(b ? x + *b : x); }},
  };
}

// Gradients of sum(f(x + b) * w) for both implementations, in float64.
TEST(ActivationTorch, AutogradMatchesATenFloat64) {
  torch::manual_seed(0);
  for (const auto& c : cases()) {
    for (bool with_bias : {false, true}) {
      auto x = (torch::randn({37, 13}, torch::kFloat64) * 3).requires_grad_();
      auto b = (torch::randn({13}, torch::kFloat64)).requires_grad_();
      auto w = torch::randn({37, 13}, torch::kFloat64);
      std::optional<at::Tensor> bias = with_bias ? std::optional<at::Tensor>(b) : std::nullopt;
      auto y1 = c.tempo(x, bias);
      auto g1 = torch::autograd::grad({(y1 * w).sum()},
                                      with_bias ? std::vector<at::Tensor>{x, b} : std::vector<at::Tensor>{x});
      auto y2 = c.reference(x, bias);
      auto g2 = torch::autograd::grad({(y2 * w).sum()},
                                      with_bias ? std::vector<at::Tensor>{x, b} : std::vector<at::Tensor>{x});
      EXPECT_TRUE(torch::allclose(y1, y2, 1e-12, 1e-14)) << c.name;
      for (size_t i = 0; i < g1.size(); ++i)
        EXPECT_TRUE(torch::allclose(g1[i], g2[i], 1e-8, 1e-9)) << c.name << " grad " << i;
    }
  }
}

TEST(ActivationTorch, Float32AndNonContiguous) {
  torch::manual_seed(1);
  for (const auto& c : cases()) {
    auto base = torch::randn({64, 48}) * 4;
    auto x = base.t().requires_grad_();  // non-contiguous view
    ASSERT_FALSE(x.is_contiguous());
    auto y1 = c.tempo(x, std::nullopt);
    auto y2 = c.reference(x, std::nullopt);
    EXPECT_EQ(y1.sizes(), x.sizes());
    EXPECT_TRUE(torch::allclose(y1, y2, 1e-5, 1e-6)) << c.name;
    auto gx1 = torch::autograd::grad({y1.sum()}, {x})[0];
    auto gx2 = torch::autograd::grad({y2.sum()}, {x})[0];
    EXPECT_TRUE(torch::allclose(gx1, gx2, 1e-4, 2e-4)) << c.name;
  }
}

TEST(ActivationTorch, ModulesAreDropIn) {
  torch::manual_seed(2);
  auto x = torch::randn({8, 16});
  tempo::nn::GELU gelu;
  tempo::nn::GELU gelu_tanh(tempo::nn::GELUOptions("tanh"));
  tempo::nn::SiLU silu;
  EXPECT_TRUE(torch::allclose(gelu(x), torch::nn::GELU()(x), 1e-5, 1e-6));
  EXPECT_TRUE(
      torch::allclose(gelu_tanh(x), torch::nn::GELU(torch::nn::GELUOptions().approximate("tanh"))(x), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(silu(x), torch::nn::SiLU()(x), 1e-5, 1e-6));
  torch::nn::Sequential mlp(torch::nn::Linear(16, 32), gelu, torch::nn::Linear(32, 4));
  mlp->forward(x).sum().backward();
  for (const auto& p : mlp->parameters()) EXPECT_TRUE(p.grad().defined());
  std::ostringstream s;
  s << *gelu_tanh;
  EXPECT_NE(s.str().find("tanh"), std::string::npos);
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error raised";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(ActivationTorch, BadInputNamesOpAndArgument) {
  auto x = torch::randn({4, 5});
  expect_error([&] { tempo::gelu(torch::ones({3}, torch::kInt)); }, {"tempo::gelu", "'x'", "Int"});
  expect_error([&] { tempo::silu(torch::ones({3}, torch::kBool)); }, {"tempo::silu", "'x'"});
  expect_error([&] { tempo::gelu(x, "none", torch::randn({4})); }, {"tempo::gelu", "'bias'", "[5]"});
  expect_error([&] { tempo::gelu(x, "none", torch::randn({5}, torch::kFloat64)); }, {"tempo::gelu", "'bias'", "dtype"});
  expect_error([&] { tempo::gelu(x, "fast"); }, {"tempo::gelu", "'approximate'", "fast"});
  expect_error([&] { tempo::nn::GELU(tempo::nn::GELUOptions("erf")); }, {"tempo::nn::GELU", "'approximate'"});
  auto [y, mask] = tempo::gelu_forward(x, "none", std::nullopt);
  expect_error([&] { tempo::gelu_backward(y, y, mask.narrow(0, 0, 1), "none"); }, {"tempo::gelu_backward", "'mask'"});
}

TEST(ActivationTorch, EmptyAndNonFinite) {
  auto e = torch::empty({0, 7}).requires_grad_();
  auto y = tempo::gelu(e);
  EXPECT_EQ(y.sizes(), e.sizes());
  y.sum().backward();
  EXPECT_EQ(e.grad().sizes(), e.sizes());
  auto x = torch::tensor({NAN, INFINITY, -INFINITY, 1.0f}).requires_grad_();
  auto ys = tempo::silu(x);
  auto ref = at::silu(x.detach());
  EXPECT_TRUE(std::isnan(ys[0].item<float>()));
  EXPECT_EQ(ys[1].item<float>(), INFINITY);
  EXPECT_EQ(std::isnan(ys[2].item<float>()), std::isnan(ref[2].item<float>()));
  ys.sum().backward();
  auto gref = torch::autograd::grad({at::silu(x).sum()}, {x})[0];
  for (int i = 0; i < 3; ++i) EXPECT_EQ(std::isnan(x.grad()[i].item<float>()), std::isnan(gref[i].item<float>()));
}

}  // namespace
