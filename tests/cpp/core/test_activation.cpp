// Kernel-core tests of the in-place activations, without LibTorch: every result is checked
// against scalar double-precision formulas written out here (C library erfc/exp/tanh).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "math/activation_f32.h"
#include "tempo/activation.h"

namespace {

using tempo::Activation;
using tempo::DType;

// ---- independent references ------------------------------------------------------------------
double ref_f(Activation a, double x) {
  switch (a) {
    case Activation::kGeluErf:
      return 0.5 * x * std::erfc(-x / std::sqrt(2.0));
    // 0.5 (1 + tanh(a)) written as 1 / (1 + e^{-2a}) so that the reference does not cancel for x << 0.
    case Activation::kGeluTanh:
      return x / (1 + std::exp(-2 * std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    case Activation::kSilu:
      return x / (1 + std::exp(-x));
  }
  return 0;
}
double ref_df(Activation a, double x) {
  switch (a) {
    case Activation::kGeluErf:
      return 0.5 * std::erfc(-x / std::sqrt(2.0)) + x * std::exp(-x * x / 2) / std::sqrt(2 * M_PI);
    case Activation::kGeluTanh: {
      const double c = std::sqrt(2 / M_PI), t = std::tanh(c * (x + 0.044715 * x * x * x));
      return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
    }
    case Activation::kSilu: {
      const double s = 1 / (1 + std::exp(-x));
      return s * (1 + x * (1 - s));
    }
  }
  return 0;
}
double ref_d2f(Activation a, double x) { return (ref_df(a, x + 1e-5) - ref_df(a, x - 1e-5)) / 2e-5; }
// Argmins from the design notes (independent of the generated tables).
double ref_xstar(Activation a) {
  switch (a) {
    case Activation::kGeluErf:
      return -0.7517915246935645;
    case Activation::kGeluTanh:
      return -0.7524614224867321;
    case Activation::kSilu:
      return -1.2784645439248923;
  }
  return 0;
}

// ---- element types as raw bits ---------------------------------------------------------------
int mantissa_bits(DType d) {
  switch (d) {
    case DType::kFloat32:
      return 24;
    case DType::kFloat64:
      return 53;
    case DType::kBFloat16:
      return 8;
    case DType::kFloat16:
      return 11;
  }
  return 0;
}
int min_exponent(DType d) { return d == DType::kFloat16 ? -14 : d == DType::kFloat64 ? -1022 : -126; }
size_t elem_size(DType d) { return d == DType::kFloat64 ? 8 : d == DType::kFloat32 ? 4 : 2; }

// Half an ulp of v in dtype d (round to nearest).
double half_ulp(DType d, double v) {
  const double a = std::fabs(v);
  int e = a > 0 ? static_cast<int>(std::floor(std::log2(a))) : min_exponent(d);
  e = std::max(e, min_exponent(d));
  return std::ldexp(0.5, e - mantissa_bits(d) + 1);
}

// Round a double to dtype d, round to nearest even, by scaling (normal and subnormal range).
double round_to(DType d, double v) {
  if (d == DType::kFloat64) return v;
  if (d == DType::kFloat32) return static_cast<float>(v);
  if (!std::isfinite(v) || v == 0) return v;
  int e = static_cast<int>(std::floor(std::log2(std::fabs(v))));
  e = std::max(e, min_exponent(d));
  const double q = std::ldexp(1.0, e - mantissa_bits(d) + 1);
  return std::nearbyint(v / q) * q;
}

// Encode/decode doubles exactly representable in d.
std::vector<unsigned char> encode(DType d, const std::vector<double>& v) {
  std::vector<unsigned char> out(v.size() * elem_size(d));
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == DType::kFloat64) {
      std::memcpy(&out[i * 8], &v[i], 8);
    } else {
      const float f = static_cast<float>(v[i]);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      if (d == DType::kFloat32) {
        std::memcpy(&out[i * 4], &u, 4);
      } else if (d == DType::kBFloat16) {
        const uint16_t h = static_cast<uint16_t>(u >> 16);  // exact for bf16-representable values
        std::memcpy(&out[i * 2], &h, 2);
      } else {
        // fp16 from a representable value: sign, exponent and 10 mantissa bits.
        uint16_t h;
        const double a = std::fabs(v[i]);
        const uint16_t sign = std::signbit(v[i]) ? 0x8000 : 0;
        if (std::isnan(v[i]))
          h = 0x7e00;
        else if (std::isinf(v[i]))
          h = sign | 0x7c00;
        else if (a < std::ldexp(1.0, -14))
          h = sign | static_cast<uint16_t>(a / std::ldexp(1.0, -24));
        else {
          const int e = static_cast<int>(std::floor(std::log2(a)));
          const uint16_t m = static_cast<uint16_t>((a / std::ldexp(1.0, e) - 1) * 1024);
          h = sign | static_cast<uint16_t>((e + 15) << 10) | m;
        }
        std::memcpy(&out[i * 2], &h, 2);
      }
    }
  }
  return out;
}
std::vector<double> decode(DType d, const std::vector<unsigned char>& b) {
  const size_t n = b.size() / elem_size(d);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (d == DType::kFloat64) {
      std::memcpy(&out[i], &b[i * 8], 8);
    } else if (d == DType::kFloat32) {
      float f;
      std::memcpy(&f, &b[i * 4], 4);
      out[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      if (d == DType::kBFloat16) {
        const uint32_t u = static_cast<uint32_t>(h) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        out[i] = f;
      } else {
        const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        const double s = (h & 0x8000) ? -1 : 1;
        if (e == 0)
          out[i] = s * m * std::ldexp(1.0, -24);
        else if (e == 31)
          out[i] = m ? std::numeric_limits<double>::quiet_NaN() : s * INFINITY;
        else
          out[i] = s * (1 + m / 1024.0) * std::ldexp(1.0, e - 15);
      }
    }
  }
  return out;
}

struct Result {
  std::vector<double> y, dx;
  std::vector<uint8_t> mask;
};

// Forward then backward (grad_y = 1) through the CPU kernels in dtype d.
Result run(Activation a, DType d, const std::vector<double>& x, const std::vector<double>* bias = nullptr) {
  const int64_t n = static_cast<int64_t>(x.size());
  auto xb = encode(d, x);
  std::vector<unsigned char> bb = bias ? encode(d, *bias) : std::vector<unsigned char>();
  std::vector<unsigned char> yb(xb.size()), gb(xb.size()), dxb(xb.size());
  Result r;
  r.mask.assign(tempo::bit_mask_bytes(n), 0xAB);
  tempo::ActivationForwardParams fp;
  fp.act = a;
  fp.dtype = d;
  fp.x = xb.data();
  fp.bias = bias ? bb.data() : nullptr;
  fp.bias_size = bias ? static_cast<int64_t>(bias->size()) : 0;
  fp.y = yb.data();
  fp.mask = r.mask.data();
  fp.numel = n;
  tempo::Status s = tempo::activation_forward_cpu(fp);
  EXPECT_TRUE(s.ok()) << s.message();
  gb = encode(d, std::vector<double>(n, 1.0));
  tempo::ActivationBackwardParams bp;
  bp.act = a;
  bp.dtype = d;
  bp.y = yb.data();
  bp.mask = r.mask.data();
  bp.grad_y = gb.data();
  bp.grad_x = dxb.data();
  bp.numel = n;
  s = tempo::activation_backward_cpu(bp);
  EXPECT_TRUE(s.ok()) << s.message();
  r.y = decode(d, yb);
  r.dx = decode(d, dxb);
  return r;
}

std::vector<double> sweep(DType d, Activation a) {
  std::vector<double> x;
  const int n = 400000;
  for (int i = 0; i < n; ++i) x.push_back(round_to(d, -20.0 + 40.0 * i / (n - 1)));
  const double xs = ref_xstar(a);
  for (int i = 0; i < 20000; ++i) x.push_back(round_to(d, xs - 1e-2 + 2e-2 * i / 19999));
  x.push_back(round_to(d, xs));
  return x;
}

const Activation kActs[] = {Activation::kGeluErf, Activation::kGeluTanh, Activation::kSilu};
const DType kTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16};

TEST(ActivationCore, ForwardMatchesReferenceWithinOneRounding) {
  for (Activation a : kActs) {
    for (DType d : kTypes) {
      const auto x = sweep(d, a);
      const Result r = run(a, d, x);
      for (size_t i = 0; i < x.size(); ++i) {
        const double ref = ref_f(a, x[i]);
        // One rounding to the storage type (plus one to fp32 first for 16-bit types), and
        // the reference's own error (the tanh form's 1 + tanh cancels for x << 0).
        double tol = 2 * half_ulp(d, ref) * (d == DType::kFloat64 ? 4 : 1.01) + 1e-300;
        if (d != DType::kFloat64) tol += half_ulp(DType::kFloat32, ref);
        // In the left tail f is ill-conditioned (relative condition number ~x^2, ~|x|^3 for
        // the tanh form): one rounding inside either formula moves the value by that much.
        tol += std::fabs(ref) * (1 + x[i] * x[i] + std::fabs(x[i] * x[i] * x[i])) * 4e-16;
        ASSERT_LE(std::fabs(r.y[i] - ref), tol)
            << tempo::activation_name(a) << " " << tempo::dtype_name(d) << " x=" << x[i];
      }
    }
  }
}

TEST(ActivationCore, MaskIsPackedBranchBit) {
  for (Activation a : kActs) {
    std::vector<double> x;
    for (int i = 0; i < 1003; ++i) x.push_back(-3.0 + 6.0 * i / 1002);  // odd length: a partial last byte
    const Result r = run(a, DType::kFloat64, x);
    ASSERT_EQ(r.mask.size(), 126u);
    for (size_t i = 0; i < x.size(); ++i) {
      const bool bit = (r.mask[i / 8] >> (i % 8)) & 1;
      ASSERT_EQ(bit, x[i] >= ref_xstar(a)) << tempo::activation_name(a) << " x=" << x[i];
    }
    for (size_t i = x.size(); i < r.mask.size() * 8; ++i) ASSERT_EQ((r.mask[i / 8] >> (i % 8)) & 1, 0);
  }
}

// The recovery bound: |g - f'(x)| <= 2 b(x) + 2 u(f'(x)) + 1e-6 with
// b(x) = min(|f''(x)| u(y) / |f'(x)|, sqrt(2 |f''(x*)| u(y*))).
TEST(ActivationCore, GradientWithinRecoveryBound) {
  for (Activation a : kActs) {
    const double xs = ref_xstar(a);
    const double d2s = ref_d2f(a, xs);
    for (DType d : kTypes) {
      const auto x = sweep(d, a);
      const Result r = run(a, d, x);
      double worst = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const double exact = ref_df(a, x[i]);
        const double uy = half_ulp(d, ref_f(a, x[i]));
        const double cap = std::sqrt(2 * std::fabs(d2s) * half_ulp(d, ref_f(a, xs)));
        const double b = exact != 0 ? std::min(std::fabs(ref_d2f(a, x[i])) * uy / std::fabs(exact), cap) : cap;
        const double bound = 2 * b + 2 * half_ulp(d, exact) + 1e-6;
        const double err = std::fabs(r.dx[i] - exact);
        worst = std::max(worst, err / bound);
        ASSERT_TRUE(std::isfinite(r.dx[i]));
        ASSERT_LE(err, bound) << tempo::activation_name(a) << " " << tempo::dtype_name(d) << " x=" << x[i]
                              << " y=" << r.y[i] << " got " << r.dx[i] << " exact " << exact;
      }
      std::printf("%-26s %-9s worst error / bound = %.3f\n", tempo::activation_name(a), tempo::dtype_name(d), worst);
    }
  }
}

// The CPU backward has SIMD versions (AVX-512, AVX2) of the scalar g(y, m); each must give
// the scalar definition's results bit for bit, on the sweep and on non-finite values.
TEST(ActivationCore, SimdPathsMatchScalar) {
  for (Activation a : kActs) {
    for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      auto x = sweep(d, a);
      for (double v : {double(NAN), double(INFINITY), double(-INFINITY), 0.0, -0.0, 1e30, -1e30}) x.push_back(v);
      const int saved = tempo::detail::set_cpu_simd(0);
      const Result scalar = run(a, d, x);
      for (int level : {1, 2}) {
        tempo::detail::set_cpu_simd(level);
        const Result simd = run(a, d, x);
        for (size_t i = 0; i < x.size(); ++i) {
          if (std::isnan(scalar.dx[i])) {
            ASSERT_TRUE(std::isnan(simd.dx[i])) << "level " << level << " x=" << x[i];
          } else {
            ASSERT_EQ(simd.dx[i], scalar.dx[i])
                << tempo::activation_name(a) << " " << tempo::dtype_name(d) << " level " << level << " x=" << x[i];
          }
        }
      }
      tempo::detail::set_cpu_simd(saved);
    }
  }
}

TEST(ActivationCore, Float64GradientNearlyExact) {
  for (Activation a : kActs) {
    std::vector<double> x;
    for (int i = 0; i < 20001; ++i) x.push_back(-20.0 + 40.0 * i / 20000);
    const Result r = run(a, DType::kFloat64, x);
    for (size_t i = 0; i < x.size(); ++i) {
      const double xs = ref_xstar(a);
      if (std::fabs(x[i] - xs) < 1e-3) continue;  // recovery there is limited by the rounding of y
      ASSERT_NEAR(r.dx[i], ref_df(a, x[i]), 1e-9) << tempo::activation_name(a) << " x=" << x[i];
    }
  }
}

TEST(ActivationCore, BiasIsAddedAlongTheLastDimension) {
  const int rows = 5, cols = 7;  // 35 elements: a partial mask byte, bias not a multiple of 8
  std::vector<double> x, bias;
  for (int i = 0; i < rows * cols; ++i) x.push_back(std::sin(i) * 2);
  for (int j = 0; j < cols; ++j) bias.push_back(0.25 * j - 0.5);
  for (Activation a : kActs) {
    const Result r = run(a, DType::kFloat64, x, &bias);
    for (int i = 0; i < rows * cols; ++i) {
      const double z = x[i] + bias[i % cols];
      ASSERT_NEAR(r.y[i], ref_f(a, z), 1e-14);
      ASSERT_NEAR(r.dx[i], ref_df(a, z), 1e-9);
      ASSERT_EQ((r.mask[i / 8] >> (i % 8)) & 1, z >= ref_xstar(a) ? 1 : 0);
    }
  }
}

TEST(ActivationCore, NonFiniteInputs) {
  const double inf = INFINITY, nan = NAN;
  for (Activation a : kActs) {
    for (DType d : kTypes) {
      const Result r = run(a, d, {nan, inf, -inf, -1e30, 1e30});
      EXPECT_TRUE(std::isnan(r.y[0]));
      EXPECT_TRUE(std::isnan(r.dx[0]));
      EXPECT_EQ(r.y[1], inf);
      EXPECT_TRUE(std::isnan(r.dx[1]));  // as PyTorch: the gradient at +-inf is NaN
      EXPECT_TRUE(std::isnan(r.y[2]));   // as PyTorch: -inf * 0
      EXPECT_TRUE(std::isnan(r.dx[2]));
      if (d == DType::kFloat32 || d == DType::kFloat64) {
        EXPECT_EQ(r.dx[3], 0.0);
        EXPECT_EQ(r.dx[4], 1.0);
      }
    }
  }
}

TEST(ActivationCore, EmptyAndInvalid) {
  tempo::ActivationForwardParams fp;
  fp.numel = 0;
  EXPECT_TRUE(tempo::activation_forward_cpu(fp).ok());
  fp.numel = 4;
  tempo::Status s = tempo::activation_forward_cpu(fp);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("non-null"), std::string::npos);
  float x[4] = {0, 1, 2, 3}, y[4], b[3] = {0, 0, 0};
  uint8_t m[1];
  fp.x = x;
  fp.y = y;
  fp.mask = m;
  fp.bias = b;
  fp.bias_size = 3;
  s = tempo::activation_forward_cpu(fp);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("bias_size"), std::string::npos);
  tempo::ActivationBackwardParams bp;
  bp.numel = -1;
  EXPECT_FALSE(tempo::activation_backward_cpu(bp).ok());
  EXPECT_FALSE(tempo::activation_forward_cuda(tempo::ActivationForwardParams{}, nullptr).ok() &&
               !tempo::build_info().cuda_compiled);
}

// The CUDA forward of 16/32-bit data uses fp32 arithmetic only (math/activation_f32.h); the
// same code runs here. Its error against the double reference over a million fp32 inputs
// spread over every binade (every 4099th bit pattern) and a fine grid around the argmin is
// within the stated kF32ForwardUlps (normal results) and one smallest-subnormal step
// (subnormal results); NaN stays NaN, +-inf as torch.
TEST(ActivationCore, Fp32ArithmeticForwardWithinItsStatedUlps) {
  for (Activation a : {Activation::kGeluErf, Activation::kGeluTanh, Activation::kSilu}) {
    float bound = 0;
    tempo::math::by_activation(a, [&](auto tag) { bound = tempo::math::kF32ForwardUlps<decltype(tag)::value>; });
    auto f32 = [&](float x) {
      float y = 0;
      tempo::math::by_activation(a, [&](auto tag) { y = tempo::math::act_forward_f32<decltype(tag)::value>(x); });
      return y;
    };
    std::vector<float> xs;
    for (uint64_t b = 0; b < (1ull << 32); b += 4099) {
      const uint32_t u = static_cast<uint32_t>(b);
      float x;
      std::memcpy(&x, &u, sizeof x);
      if (std::isfinite(x)) xs.push_back(x);
    }
    for (int i = -20000; i <= 20000; ++i) xs.push_back(static_cast<float>(ref_xstar(a) + i * 1e-6));
    double worst = 0, worst_x = 0, worst_sub = 0;
    for (float x : xs) {
      const double ref = ref_f(a, static_cast<double>(x));
      const float y = f32(x);
      const float r = static_cast<float>(ref);
      const bool sub = std::fabs(r) < std::numeric_limits<float>::min();
      int e = 0;
      std::frexp(r, &e);
      const double ulp = sub ? std::ldexp(1.0, -149) : std::ldexp(1.0, e - 24);
      const double err = std::fabs(static_cast<double>(y) - ref) / ulp;
      if (sub)
        worst_sub = std::max(worst_sub, err);
      else if (err > worst)
        worst = err, worst_x = x;
    }
    EXPECT_LE(worst, bound) << "activation " << static_cast<int>(a) << " at x = " << worst_x;
    EXPECT_LE(worst_sub, 1.0) << "activation " << static_cast<int>(a);
    EXPECT_GT(worst, 0.3) << "the sweep should see fp32 rounding at all";
    // The CUDA backward reads this forward's y: its gradient (the same g(y, m), run here) stays
    // within the recovery bound with u(y) widened from half an ulp to the forward's stated error.
    const double xstar = ref_xstar(a), d2s = ref_d2f(a, xstar), widen = 2.0 * bound;
    const auto grid = sweep(DType::kFloat32, a);
    double worst_ratio = 0;
    for (double xd : grid) {
      const float x = static_cast<float>(xd);
      float g = 0;
      tempo::math::by_activation(a, [&](auto tag) {
        constexpr Activation A = decltype(tag)::value;
        g = tempo::math::act_grad_from_output<A>(tempo::math::act_forward_f32<A>(x), tempo::math::act_branch<A>(x));
      });
      const double exact = ref_df(a, x);
      const double uy = widen * half_ulp(DType::kFloat32, ref_f(a, x));
      const double cap = std::sqrt(2 * std::fabs(d2s) * widen * half_ulp(DType::kFloat32, ref_f(a, xstar)));
      const double b = exact != 0 ? std::min(std::fabs(ref_d2f(a, x)) * uy / std::fabs(exact), cap) : cap;
      const double lim = 2 * b + 2 * half_ulp(DType::kFloat32, exact) + 1e-6;
      worst_ratio = std::max(worst_ratio, std::fabs(g - exact) / lim);
      ASSERT_LE(std::fabs(g - exact), lim)
          << tempo::activation_name(a) << " x=" << x << " g=" << g << " exact " << exact;
    }
    std::printf("%-26s fp32 forward: worst %.3f ulp (normal), %.3f (subnormal); gradient error / widened bound %.3f\n",
                tempo::activation_name(a), worst, worst_sub, worst_ratio);
    const float inf = std::numeric_limits<float>::infinity();
    EXPECT_TRUE(std::isnan(f32(std::numeric_limits<float>::quiet_NaN())));
    EXPECT_EQ(f32(inf), inf);
    EXPECT_TRUE(std::isnan(f32(-inf)));  // as PyTorch and the CPU kernels: -inf * 0
    EXPECT_EQ(f32(1e30f), 1e30f);
    EXPECT_EQ(f32(-1e30f), 0.0f);
  }
}

}  // namespace

// The CUDA forward of bf16/fp16 data (act_forward_plain: plain fp32 arithmetic), over every
// finite 16-bit input: within kF16PathForwardUlps of the exact value, in ulps of the 16-bit
// result (subnormal results: of the smallest subnormal). Here with the host's expf / erfcf;
// the CUDA cases of tests/python/ops/test_activation.py run the same sweep with the device's.
TEST(ActivationCore, SixteenBitForwardWithinItsStatedUlpsOnEveryInput) {
  using tempo::math::bf16_t;
  using tempo::math::fp16_t;
  for (Activation a : {Activation::kGeluErf, Activation::kGeluTanh, Activation::kSilu}) {
    for (int fp16 = 0; fp16 < 2; ++fp16) {
      const int mant = fp16 ? 11 : 8;
      const double sub = fp16 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -133);
      const double max_finite = fp16 ? 65504.0 : 3.3895313892515355e38;
      double worst = 0, worst_x = 0;
      int64_t inexact = 0, n = 0;
      for (uint32_t b = 0; b < 65536; ++b) {
        float x, y16;
        if (fp16) {
          const fp16_t h{static_cast<uint16_t>(b)};
          x = tempo::math::to_float(h);
        } else {
          x = tempo::math::to_float(bf16_t{static_cast<uint16_t>(b)});
        }
        if (!std::isfinite(x)) continue;
        float y = 0;
        tempo::math::by_activation(a, [&](auto tag) { y = tempo::math::act_forward_plain<decltype(tag)::value>(x); });
        if (fp16) {
          fp16_t o;
          tempo::math::store(&o, y);
          y16 = tempo::math::to_float(o);
        } else {
          bf16_t o;
          tempo::math::store(&o, y);
          y16 = tempo::math::to_float(o);
        }
        const double ref = ref_f(a, static_cast<double>(x));
        if (std::fabs(ref) > max_finite) continue;
        int e = 0;
        std::frexp(ref, &e);
        const double ulp = std::max(std::ldexp(1.0, e - mant), sub);
        const double err = std::fabs(static_cast<double>(y16) - ref) / ulp;
        ++n;
        inexact += err > 0.5;
        if (err > worst) worst = err, worst_x = x;
      }
      EXPECT_LE(worst, tempo::math::kF16PathForwardUlps)
          << tempo::activation_name(a) << (fp16 ? " fp16" : " bf16") << " at x = " << worst_x;
      EXPECT_GT(n, 60000);
      std::printf("%-26s %s forward (plain fp32): worst %.6f ulp at x = %g; %lld of %lld past half an ulp\n",
                  tempo::activation_name(a), fp16 ? "fp16" : "bf16", worst, worst_x, static_cast<long long>(inexact),
                  static_cast<long long>(n));
    }
  }
}
