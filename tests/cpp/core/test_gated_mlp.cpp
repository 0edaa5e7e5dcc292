// Kernel-core tests of the gated MLP's elementwise part, without LibTorch: h = act(gate) * up and
// its backward (dL/dgate, dL/dup and h again) for SiLU, the erf GELU and the tanh GELU, in fp32
// and fp64, reading gate and up in place from one fused gate_up row ([rows, 2 cols]) and writing
// strided gradients, against scalar loops in long double within gated_mlp.h's stated bounds;
// parameters a backend would misread are rejected.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "tempo/gated_mlp.h"

namespace {

constexpr int64_t kRows = 7, kCols = 37;  // an odd width: the vector loops' tails

// act(g) = f(g) and act'(g) = f1 + f2, the two terms the derivative is the sum of (gated_mlp.h).
struct Act {
  long double value, f1, f2;
};

Act reference(tempo::Activation act, long double g) {
  if (act == tempo::Activation::kSilu) {
    const long double s = 1.0L / (1.0L + std::exp(-g));
    return {g * s, s, g * s * (1.0L - s)};
  }
  if (act == tempo::Activation::kGeluErf) {
    const long double cdf = 0.5L * std::erfc(-g / std::sqrt(2.0L));
    const long double pdf = std::exp(-0.5L * g * g) / std::sqrt(2.0L * 3.14159265358979323846264338327950288L);
    return {g * cdf, cdf, g * pdf};
  }
  // 0.5 (1 + tanh u) as the sigmoid of 2u: no cancellation in the negative tail (1 + tanh u
  // loses every digit of long double below u = -22)
  const long double c = std::sqrt(2.0L / 3.14159265358979323846264338327950288L);
  const long double u = c * (g + 0.044715L * g * g * g);
  const long double s = 1.0L / (1.0L + std::exp(-2.0L * u)), sc = 1.0L / (1.0L + std::exp(2.0L * u));
  return {g * s, s, 2.0L * g * s * sc * c * (1.0L + 3.0L * 0.044715L * g * g)};
}

template <typename T>
struct Case {
  tempo::Activation act;
  std::vector<T> gate_up, grad_h;  // gate_up: rows x 2 cols, gate first
  explicit Case(tempo::Activation a) : act(a), gate_up(kRows * 2 * kCols), grad_h(kRows * kCols) {
    std::mt19937 gen(static_cast<unsigned>(a) + 3);
    std::normal_distribution<double> nd;
    for (auto& v : gate_up) v = static_cast<T>(3 * nd(gen));
    for (auto& v : grad_h) v = static_cast<T>(nd(gen));
    gate_up[0] = T(0);    // act's and act''s value at 0
    gate_up[1] = T(-30);  // far tails
    gate_up[2] = T(30);
  }
  T gate(int64_t r, int64_t c) const { return gate_up[r * 2 * kCols + c]; }
  T up(int64_t r, int64_t c) const { return gate_up[r * 2 * kCols + kCols + c]; }
};

// The relative error the CPU kernels keep to (gated_mlp.h): 0.5 ulp of the data's type and 1e-9
// for fp32 (double evaluation, one rounding); for fp64 a few ulp of double (the C library's
// functions) plus the amplification of the rounding of exp's or erfc's argument in the tails:
// |z| ulps for e^-|z| (z = g, or 2u for the tanh GELU), 2 (g / sqrt 2)^2 for erfc.
template <typename T>
long double bound(long double g) {
  if (std::is_same_v<T, float>) return std::ldexp(1.0L, -24) + 1e-9L;
  const long double z = std::fabs(g) * (2.0L + 0.09L * g * g);
  return std::numeric_limits<double>::epsilon() * (8.0L + 4.0L * z + g * g);
}

template <typename T>
void check(tempo::Activation act) {
  Case<T> c(act);
  const auto dtype = std::is_same_v<T, float> ? tempo::DType::kFloat32 : tempo::DType::kFloat64;
  std::vector<T> h(kRows * kCols, T(-1));
  tempo::GatedMlpForwardParams f;
  f.act = act;
  f.dtype = dtype;
  f.gate = c.gate_up.data();
  f.up = c.gate_up.data() + kCols;
  f.rows = kRows;
  f.cols = kCols;
  f.gate_stride = f.up_stride = 2 * kCols;
  f.h = h.data();
  ASSERT_TRUE(tempo::gated_mlp_forward_cpu(f).ok());

  // the gradients written into one fused [rows, 2 cols] buffer, as the op's backward does
  std::vector<T> grad(kRows * 2 * kCols, T(-1)), h2(kRows * kCols, T(-1));
  tempo::GatedMlpBackwardParams b;
  b.act = act;
  b.dtype = dtype;
  b.gate = f.gate;
  b.up = f.up;
  b.rows = kRows;
  b.cols = kCols;
  b.gate_stride = b.up_stride = 2 * kCols;
  b.grad_h = c.grad_h.data();
  b.grad_gate = grad.data();
  b.grad_up = grad.data() + kCols;
  b.grad_gate_stride = b.grad_up_stride = 2 * kCols;
  b.h = h2.data();
  ASSERT_TRUE(tempo::gated_mlp_backward_cpu(b).ok());

  const long double tiny = std::numeric_limits<T>::denorm_min();
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kCols; ++j) {
      const long double g = c.gate(r, j), u = c.up(r, j), dh = c.grad_h[r * kCols + j], tol = bound<T>(g);
      const Act a = reference(act, g);
      const long double want_h = a.value * u, want_up = dh * a.value, want_gate = dh * u * (a.f1 + a.f2);
      const long double scale_gate = std::fabs(dh * u) * (std::fabs(a.f1) + std::fabs(a.f2));
      const T got_h = h[r * kCols + j];
      EXPECT_LE(std::fabs(got_h - want_h), tol * std::fabs(want_h) + tiny) << r << "," << j << " g " << g;
      EXPECT_LE(std::fabs(grad[r * 2 * kCols + kCols + j] - want_up), tol * std::fabs(want_up) + tiny) << r << "," << j;
      EXPECT_LE(std::fabs(grad[r * 2 * kCols + j] - want_gate), tol * scale_gate + tiny) << r << "," << j << " g " << g;
      // the backward's h: the forward's bits
      EXPECT_EQ(h2[r * kCols + j], got_h) << r << "," << j;
    }
  }
}

TEST(GatedMlpCore, EveryActivationInFp32AgainstLongDouble) {
  for (auto act : {tempo::Activation::kSilu, tempo::Activation::kGeluErf, tempo::Activation::kGeluTanh}) {
    SCOPED_TRACE(tempo::activation_name(act));
    check<float>(act);
  }
}

TEST(GatedMlpCore, EveryActivationInFp64AgainstLongDouble) {
  for (auto act : {tempo::Activation::kSilu, tempo::Activation::kGeluErf, tempo::Activation::kGeluTanh}) {
    SCOPED_TRACE(tempo::activation_name(act));
    check<double>(act);
  }
}

TEST(GatedMlpCore, ParametersABackendWouldMisreadAreRefused) {
  std::vector<float> a(2 * kCols), out(kCols);
  tempo::GatedMlpForwardParams f;
  f.gate = a.data();
  f.up = a.data() + kCols;
  f.h = out.data();
  f.rows = 1;
  f.cols = kCols;
  f.gate_stride = f.up_stride = 2 * kCols;
  ASSERT_TRUE(tempo::gated_mlp_forward_cpu(f).ok());
  auto bad = f;
  bad.gate_stride = kCols - 1;  // rows would overlap
  EXPECT_FALSE(tempo::gated_mlp_forward_cpu(bad).ok());
  bad = f;
  bad.rows = -1;
  EXPECT_FALSE(tempo::gated_mlp_forward_cpu(bad).ok());
  bad = f;
  bad.h = nullptr;
  EXPECT_FALSE(tempo::gated_mlp_forward_cpu(bad).ok());
  bad = f;
  bad.act = static_cast<tempo::Activation>(7);
  EXPECT_FALSE(tempo::gated_mlp_forward_cpu(bad).ok());
  bad = f;
  bad.dtype = static_cast<tempo::DType>(99);
  EXPECT_FALSE(tempo::gated_mlp_forward_cpu(bad).ok());
  bad = f;
  bad.rows = std::numeric_limits<int64_t>::max() / 2;  // rows * stride overflows
  EXPECT_FALSE(tempo::gated_mlp_forward_cpu(bad).ok());
  bad = f;  // nothing to do: no pointer is read
  bad.rows = 0;
  bad.gate = bad.up = nullptr;
  bad.h = nullptr;
  EXPECT_TRUE(tempo::gated_mlp_forward_cpu(bad).ok());

  std::vector<float> dh(kCols), dg(kCols), du(kCols);
  tempo::GatedMlpBackwardParams b;
  b.gate = f.gate;
  b.up = f.up;
  b.rows = 1;
  b.cols = kCols;
  b.gate_stride = b.up_stride = 2 * kCols;
  b.grad_h = dh.data();
  b.grad_gate = dg.data();
  b.grad_up = du.data();
  b.grad_gate_stride = b.grad_up_stride = kCols;
  ASSERT_TRUE(tempo::gated_mlp_backward_cpu(b).ok());
  auto bb = b;
  bb.grad_up_stride = kCols - 1;
  EXPECT_FALSE(tempo::gated_mlp_backward_cpu(bb).ok());
  bb = b;
  bb.grad_gate = nullptr;
  EXPECT_FALSE(tempo::gated_mlp_backward_cpu(bb).ok());
}

}  // namespace
