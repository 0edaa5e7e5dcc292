// Second derivatives from LibTorch: every tempo op whose backward keeps the output refuses a
// second differentiation with its own error, reached by backward() and by autograd::grad with
// inputs (allow_unused too, which would read an unreached refusal as an undefined, that is
// zero, gradient); dropout and tempo::nn::checkpoint over twice-differentiable code give
// ATen's second derivatives (float64).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>

#include "tempo/models.h"
#include "tempo/nn/checkpoint.h"

namespace {

using Fn = std::function<at::Tensor(const at::Tensor&)>;

struct Op {
  const char* name;
  Fn f;  // of x [4, 6], float64
};

std::vector<Op> refusing_ops() {
  auto ones = torch::ones({6}, torch::kFloat64);
  auto zeros = torch::zeros({6}, torch::kFloat64);
  auto w = torch::randn({5, 6}, torch::kFloat64);
  auto q4 = [](const at::Tensor& x) { return x.view({1, 1, 4, 6}); };
  return {
      {"gelu", [](const at::Tensor& x) { return tempo::gelu(x); }},
      {"silu", [](const at::Tensor& x) { return tempo::silu(x); }},
      {"layer_norm", [=](const at::Tensor& x) { return tempo::layer_norm(x, {6}, ones, zeros); }},
      {"rms_norm", [=](const at::Tensor& x) { return tempo::rms_norm(x, {6}, ones); }},
      {"bias_dropout_add_layer_norm",
       [=](const at::Tensor& x) { return tempo::bias_dropout_add_layer_norm(x, std::nullopt, x, 0.0, ones, zeros); }},
      {"attention", [=](const at::Tensor& x) { return tempo::attention(q4(x), q4(x), q4(x)); }},
      {"fused_attention", [=](const at::Tensor& x) { return tempo::fused_attention(q4(x), q4(x), q4(x)); }},
      {"causal_linear_attention",
       [=](const at::Tensor& x) {
         auto e = x.exp().view({1, 4, 6});
         return std::get<0>(tempo::causal_linear_attention(e, e, x.view({1, 4, 6})));
       }},
      {"linear_cross_entropy",
       [=](const at::Tensor& x) {
         return tempo::linear_cross_entropy(x, w, std::nullopt, torch::tensor({1, 2, 3, 4}), -100, 0.0, "none");
       }},
      {"qkv_split",
       [](const at::Tensor& x) {
         auto [q, k, v] = tempo::qkv_split(x.view({1, 2, 12}), std::nullopt, 2);
         return q * k * v;
       }},
  };
}

// Runs `f`, which must raise an error holding `what`.
void expect_refusal(const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no error; expected " << what;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(SecondDerivatives, EveryRefusingOpRaisesItsErrorThroughGradWithInputs) {
  torch::manual_seed(0);
  for (const auto& op : refusing_ops()) {
    SCOPED_TRACE(op.name);
    const std::string what = std::string("tempo::") + op.name + ": double backward";
    auto x = torch::randn({4, 6}, torch::kFloat64).requires_grad_();
    auto g = torch::autograd::grad({op.f(x).square().sum()}, {x}, {}, true, /*create_graph=*/true)[0];
    ASSERT_TRUE(g.requires_grad());
    // inputs= with allow_unused: before, an undefined gradient (zero to its callers).
    expect_refusal([&] { torch::autograd::grad({g.sum()}, {x}, {}, true, false, /*allow_unused=*/true); }, what);
    expect_refusal([&] { torch::autograd::grad({g.sum()}, {x}, {}, true, false, false); }, what);
    expect_refusal([&] { g.sum().backward({}, true); }, what);
    // A gradient that reaches the op only through the incoming gradient: y's own
    // dependence on x does not count, the penalty's on the op's gradient does.
    auto x2 = torch::randn({4, 6}, torch::kFloat64).requires_grad_();
    auto s = torch::randn({4, 6}, torch::kFloat64).requires_grad_();
    auto g2 = torch::autograd::grad({(op.f(x2) * op.f(x2).detach()).sum() * s.sum()}, {x2}, {}, true, true)[0];
    expect_refusal([&] { torch::autograd::grad({g2.sum()}, {s}, {}, true, false, true); }, what);
  }
}

TEST(SecondDerivatives, NormWeightGradientRefusesToo) {
  auto x = torch::randn({4, 6}, torch::kFloat64);
  auto w = torch::randn({6}, torch::kFloat64).requires_grad_();
  auto gw = torch::autograd::grad({tempo::rms_norm(x, {6}, w).pow(3).sum()}, {w}, {}, true, true)[0];
  expect_refusal([&] { torch::autograd::grad({gw.sum()}, {w}, {}, true, false, true); }, "tempo::rms_norm: double");
}

// Hessian-vector product of sum(f(x)^3) in x along v, by double backward.
at::Tensor hvp(const Fn& f, const at::Tensor& x0, const at::Tensor& v) {
  auto x = x0.detach().clone().requires_grad_();
  auto g = torch::autograd::grad({f(x).pow(3).sum()}, {x}, {}, true, true)[0];
  auto h = torch::autograd::grad({(g * v).sum()}, {x}, {}, true, false, true)[0];
  EXPECT_TRUE(h.defined());
  return h;
}

TEST(SecondDerivatives, DropoutIsTwiceDifferentiable) {
  for (const char* mode : {"bits", "philox"}) {
    auto x = torch::randn({5, 7}, torch::kFloat64);
    auto v = torch::randn({5, 7}, torch::kFloat64);
    torch::manual_seed(11);
    auto keep = tempo::dropout(torch::ones({5, 7}, torch::kFloat64), 0.3, true, mode);  // 0 or 1/(1-p)
    auto ours = hvp(
        [&](const at::Tensor& t) {
          torch::manual_seed(11);
          return tempo::dropout(t, 0.3, true, mode);
        },
        x, v);
    auto ref = hvp([&](const at::Tensor& t) { return t * keep; }, x, v);
    EXPECT_TRUE(torch::allclose(ours, ref, 1e-12, 1e-12)) << mode;
    EXPECT_GT(ours.abs().sum().item<double>(), 0.0);
  }
}

TEST(SecondDerivatives, CheckpointOfTwiceDifferentiableCodeGivesATensHessian) {
  torch::manual_seed(3);
  torch::nn::Linear lin(6, 6);
  lin->to(torch::kFloat64);
  auto body = [&](const std::vector<at::Tensor>& in) { return torch::tanh(lin(in[0])) * in[1]; };
  auto x0 = torch::randn({4, 6}, torch::kFloat64);
  auto s0 = torch::randn({4, 6}, torch::kFloat64);
  // A gradient penalty: |d loss / d x|^2, differentiated in x, s and the Linear's weight.
  auto run = [&](bool ckpt) {
    auto x = x0.clone().requires_grad_();
    auto s = s0.clone().requires_grad_();
    auto h = x * 1.5;  // a non-leaf input, whose history leads back to x
    auto y = ckpt ? tempo::nn::checkpoint(body, {h, s}) : body({h, s});
    auto gx = torch::autograd::grad({y.pow(2).sum()}, {x}, {}, true, true)[0];
    lin->weight.mutable_grad() = at::Tensor();
    gx.square().sum().backward();
    return std::vector<at::Tensor>{x.grad(), s.grad(), lin->weight.grad().clone()};
  };
  auto want = run(false);
  auto got = run(true);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << i;
    EXPECT_GT(want[i].abs().sum().item<double>(), 0.0) << i;
    EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-10, 1e-12)) << i << "\n" << got[i] << "\n" << want[i];
  }
}

TEST(SecondDerivatives, CheckpointOfARefusingOpRaisesItsError) {
  auto body = [](const std::vector<at::Tensor>& in) { return tempo::gelu(in[0]); };
  auto x = torch::randn({4, 6}, torch::kFloat64).requires_grad_();
  auto g = torch::autograd::grad({tempo::nn::checkpoint(body, {x}).square().sum()}, {x}, {}, true, true)[0];
  expect_refusal([&] { torch::autograd::grad({g.sum()}, {x}, {}, true, false, true); }, "tempo::gelu: double");
}

}  // namespace
