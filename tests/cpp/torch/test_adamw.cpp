// tempo::train::AdamW, the trainer's optimizer: on the CPU each step is bitwise IEEE float
// arithmetic, operation by operation (a reference that rounds each operation's exact double
// result to float, which no compiler contraction can change); it is the update of
// torch::optim::AdamW within float rounding, and of an fp64 AdamW within fp32's error;
// bitwise across thread counts; its checkpoints load into torch's AdamW and back; bad input
// gets clear errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "tempo/train/adamw.h"

namespace {

using tempo::train::AdamW;

struct Hyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-6, wd = 0.01;
  bool amsgrad = false;
};

torch::optim::AdamWOptions options(const Hyper& h) {
  return torch::optim::AdamWOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.wd).amsgrad(h.amsgrad);
}

// One operation in IEEE float: the exact (or, for / and sqrt, correctly rounded) double result
// rounded to float, which is the correctly rounded float result (double has >= 2*24+2 bits).
float f(double x) { return static_cast<float>(x); }

// The AdamW step as a scalar loop in IEEE float arithmetic, in tempo's order of operations.
void reference_step(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m, std::vector<float>& v,
                    std::vector<float>& vmax, int64_t step, const Hyper& h) {
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  const float decay = f(1 - h.lr * h.wd), b1 = f(h.beta1), a1 = f(1 - h.beta1), b2 = f(h.beta2), a2 = f(1 - h.beta2);
  const float root_bc2 = f(std::sqrt(bc2)), e = f(h.eps), step_size = f(h.lr / bc1);
  for (size_t i = 0; i < p.size(); ++i) {
    const float mi = f(double(f(double(b1) * m[i])) + double(f(double(a1) * g[i])));
    float vi = f(double(f(double(b2) * v[i])) + double(f(double(f(double(a2) * g[i])) * g[i])));
    m[i] = mi;
    v[i] = vi;
    if (h.amsgrad) vi = vmax[i] = std::max(vmax[i], vi);
    const float denom = f(double(f(double(f(std::sqrt(double(vi)))) / root_bc2)) + e);
    p[i] = f(double(f(double(p[i]) * decay)) - double(f(double(step_size) * f(double(mi) / denom))));
  }
}

std::vector<float> values(const at::Tensor& t) {
  const at::Tensor c = t.detach().contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

// Gradients for step s of a parameter: a wide range of magnitudes (tiny second moments are
// where a square root's last bit shows), some exact zeros.
at::Tensor gradient(const at::Tensor& p, int64_t s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s);
  at::Tensor g =
      at::randn(p.sizes(), gen, at::kFloat) * at::pow(10.0, at::randint(-8, 2, p.sizes(), gen).to(at::kFloat));
  return g.masked_fill_(at::rand(p.sizes(), gen) < 0.05, 0).to(p.scalar_type());
}

// Parameters of awkward sizes: one element, a prime, one that spans several threads' ranges.
std::vector<at::Tensor> parameters() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return {at::randn({1}, gen), at::randn({7, 13}, gen), at::randn({70001}, gen), at::randn({64, 3}, gen)};
}

// Runs `steps` steps of optimizer type O over copies of `init`; returns the parameters after.
template <typename O>
std::vector<at::Tensor> run(const std::vector<at::Tensor>& init, const Hyper& h, int steps) {
  std::vector<at::Tensor> ps;
  for (const auto& t : init) ps.push_back(t.clone().requires_grad_());
  O opt(ps, options(h));
  for (int s = 1; s <= steps; ++s) {
    for (auto& p : ps) p.mutable_grad() = gradient(p, s);
    opt.step();
  }
  return ps;
}

TEST(AdamW, EachStepIsIeeeFloatArithmeticBitwise) {
  for (const bool amsgrad : {false, true}) {
    Hyper h;
    h.amsgrad = amsgrad;
    const auto init = parameters();
    std::vector<at::Tensor> ps;
    for (const auto& t : init) ps.push_back(t.clone().requires_grad_());
    AdamW opt(ps, options(h));
    std::vector<std::vector<float>> rp, rm, rv, rmax;
    for (const auto& t : init) {
      rp.push_back(values(t));
      rm.emplace_back(t.numel(), 0.f), rv.emplace_back(t.numel(), 0.f), rmax.emplace_back(t.numel(), 0.f);
    }
    for (int s = 1; s <= 6; ++s) {
      for (size_t i = 0; i < ps.size(); ++i) {
        ps[i].mutable_grad() = gradient(ps[i], s);
        reference_step(rp[i], values(ps[i].grad()), rm[i], rv[i], rmax[i], s, h);
      }
      opt.step();
      for (size_t i = 0; i < ps.size(); ++i) {
        const auto got = values(ps[i]);
        size_t differ = 0;
        for (size_t k = 0; k < got.size(); ++k) differ += got[k] != rp[i][k];
        EXPECT_EQ(differ, 0u) << "amsgrad " << amsgrad << ", step " << s << ", parameter " << i << " (" << got.size()
                              << " elements)";
      }
    }
  }
}

TEST(AdamW, IsTorchsAdamWWithinFloatRoundingAndFp64sWithinFp32Error) {
  for (const bool amsgrad : {false, true}) {
    Hyper h;
    h.amsgrad = amsgrad;
    const auto init = parameters();
    const auto ours = run<AdamW>(init, h, 10);
    const auto torchs = run<torch::optim::AdamW>(init, h, 10);
    std::vector<at::Tensor> init64;
    for (const auto& t : init) init64.push_back(t.to(at::kDouble));
    std::vector<at::Tensor> exact;  // torch's AdamW in fp64, on the same float gradients
    {
      std::vector<at::Tensor> ps;
      for (const auto& t : init64) ps.push_back(t.clone().requires_grad_());
      torch::optim::AdamW opt(ps, options(h));
      for (int s = 1; s <= 10; ++s) {
        for (auto& p : ps) p.mutable_grad() = gradient(p.to(at::kFloat), s).to(at::kDouble);
        opt.step();
      }
      exact = ps;
    }
    for (size_t i = 0; i < init.size(); ++i) {
      // 10 steps of lr 1e-3 move a parameter by at most about 1e-2; each step's float rounding is
      // a few ulps of the parameter and of the update.
      const double ours_err = (ours[i].to(at::kDouble) - exact[i]).abs().max().item<double>();
      const double torch_err = (torchs[i].to(at::kDouble) - exact[i]).abs().max().item<double>();
      const double scale = init64[i].abs().max().item<double>() + 1e-2;
      EXPECT_LE(ours_err, 4e-6 * scale) << "parameter " << i << ", amsgrad " << amsgrad;
      EXPECT_LE((ours[i] - torchs[i]).abs().max().item<double>(), 4e-6 * scale) << "parameter " << i;
      EXPECT_LE(ours_err, 2 * torch_err + 1e-7 * scale) << "parameter " << i;  // no worse than torch's
    }
  }
}

TEST(AdamW, BitwiseTheSameAtAnyThreadCount) {
  const int before = at::get_num_threads();
  const auto init = parameters();
  at::set_num_threads(1);
  const auto one = run<AdamW>(init, Hyper{}, 4);
  for (const int n : {2, 3}) {
    at::set_num_threads(n);
    const auto many = run<AdamW>(init, Hyper{}, 4);
    for (size_t i = 0; i < init.size(); ++i)
      EXPECT_TRUE(at::equal(one[i], many[i])) << n << " threads, parameter " << i;
  }
  at::set_num_threads(before);
}

TEST(AdamW, NonContiguousAndDoubleAndBfloat16Parameters) {
  Hyper h;
  // A transposed parameter: the same bits as its contiguous copy.
  const at::Tensor base = at::randn({33, 17});
  at::Tensor t = base.t().contiguous().t();  // column-major storage
  ASSERT_FALSE(t.is_contiguous());
  auto a = run<AdamW>({t}, h, 3);
  auto b = run<AdamW>({base.contiguous()}, h, 3);
  EXPECT_TRUE(at::equal(a[0].contiguous(), b[0]));
  // double: the CPU pass against torch's AdamW in double.
  const auto d = run<AdamW>({base.to(at::kDouble)}, h, 3);
  const auto dt = run<torch::optim::AdamW>({base.to(at::kDouble)}, h, 3);
  EXPECT_LE((d[0] - dt[0]).abs().max().item<double>(), 1e-12 * base.abs().max().item<double>());
  // bfloat16 (the tensor-op path) within bfloat16's rounding of the float update.
  at::Tensor p16 = base.to(at::kBFloat16).requires_grad_();
  AdamW opt16({p16}, options(h));
  at::Tensor p32 = base.to(at::kBFloat16).to(at::kFloat).requires_grad_();
  AdamW opt32({p32}, options(h));
  for (int s = 1; s <= 3; ++s) {
    const at::Tensor g = gradient(p32, s);
    p16.mutable_grad() = g.to(at::kBFloat16);
    p32.mutable_grad() = g.to(at::kBFloat16).to(at::kFloat);
    opt16.step();
    opt32.step();
  }
  EXPECT_LE((p16.to(at::kFloat) - p32).abs().max().item<double>(), 3 * 0.0078125 * (base.abs().max().item<double>()));
}

TEST(AdamW, CheckpointsLoadIntoTorchsAdamWAndBack) {
  Hyper h;
  const auto init = parameters();
  std::vector<at::Tensor> ps;
  for (const auto& t : init) ps.push_back(t.clone().requires_grad_());
  AdamW ours(ps, options(h));
  for (int s = 1; s <= 2; ++s) {
    for (auto& p : ps) p.mutable_grad() = gradient(p, s);
    ours.step();
  }
  std::stringstream saved;
  torch::save(ours, saved);
  torch::optim::AdamW theirs(ps, options(h));
  torch::load(theirs, saved);
  std::stringstream again;
  torch::save(theirs, again);
  AdamW back(ps, options(h));
  torch::load(back, again);
  for (const auto& p : ps) {
    const auto& a = static_cast<torch::optim::AdamWParamState&>(*ours.state().at(p.unsafeGetTensorImpl()));
    const auto& b = static_cast<torch::optim::AdamWParamState&>(*theirs.state().at(p.unsafeGetTensorImpl()));
    const auto& c = static_cast<torch::optim::AdamWParamState&>(*back.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(a.step(), 2);
    EXPECT_EQ(b.step(), 2);
    EXPECT_EQ(c.step(), 2);
    EXPECT_TRUE(at::equal(a.exp_avg(), b.exp_avg()) && at::equal(a.exp_avg_sq(), b.exp_avg_sq()));
    EXPECT_TRUE(at::equal(a.exp_avg(), c.exp_avg()) && at::equal(a.exp_avg_sq(), c.exp_avg_sq()));
  }
}

TEST(AdamW, BadInputIsRefusedByName) {
  const at::Tensor p = at::zeros({4}), g = at::zeros({4}), m = at::zeros({4}), v = at::zeros({4});
  const auto refused = [](const std::function<void()>& call, const std::string& needle) {
    try {
      call();
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("adamw_update"), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
      return;
    }
    ADD_FAILURE() << "not refused: " << needle;
  };
  using tempo::train::adamw_update;
  refused([&] { adamw_update(p, at::zeros({5}), m, v, {}, 1, 1e-3, 0.9, 0.999, 1e-6, 0); }, "grad has shape");
  refused([&] { adamw_update(p, g, at::zeros({4}, at::kDouble), v, {}, 1, 1e-3, 0.9, 0.999, 1e-6, 0); }, "exp_avg is");
  refused([&] { adamw_update(p, g, m, at::Tensor(), {}, 1, 1e-3, 0.9, 0.999, 1e-6, 0); }, "exp_avg_sq is undefined");
  refused([&] { adamw_update(p, g, m, v, {}, 0, 1e-3, 0.9, 0.999, 1e-6, 0); }, "step counts from 1");
  refused([&] { adamw_update(p, g, m, v, {}, 1, 1e-3, 1.0, 0.999, 1e-6, 0); }, "betas in [0, 1)");
  refused([&] { adamw_update(p, g, m, v, {}, 1, -1.0, 0.9, 0.999, 1e-6, 0); }, "lr, eps, weight_decay >= 0");
  refused([&] { adamw_update(at::zeros({4}, at::kLong), g, m, v, {}, 1, 1e-3, 0.9, 0.999, 1e-6, 0); },
          "floating-point");
  refused([&] { adamw_update(p, g.to_sparse(), m, v, {}, 1, 1e-3, 0.9, 0.999, 1e-6, 0); }, "sparse");
  // Nothing was written by a refused call.
  EXPECT_TRUE(at::equal(p, at::zeros({4})));
}

}  // namespace
