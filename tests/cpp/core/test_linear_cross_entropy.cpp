// Kernel-core tests of linear_cross_entropy's row passes, without LibTorch: the forward's
// log-sum-exp and loss per row (label smoothing, an ignored row, a label out of range clamped, a
// row of -inf but one logit) and the backward's in-place gradient of the logits, in fp32 and fp64,
// against scalar loops in long double; parameters a backend would misread are rejected.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "tempo/linear_cross_entropy.h"

namespace {

constexpr int64_t kRows = 6, kVocab = 203;
constexpr int64_t kIgnore = -100;

template <typename T>
void check(double smoothing) {
  const auto dtype = std::is_same_v<T, float> ? tempo::DType::kFloat32 : tempo::DType::kFloat64;
  std::mt19937 gen(4);
  std::normal_distribution<double> nd;
  std::vector<T> z(kRows * kVocab);
  for (auto& x : z) x = static_cast<T>(4 * nd(gen));
  for (int64_t j = 0; j < kVocab; ++j) z[3 * kVocab + j] = j == 5 ? T(2) : -std::numeric_limits<T>::infinity();
  z[4 * kVocab + 11] = T(80);  // one logit far above the rest: the shift by the row's maximum
  const std::vector<int64_t> labels = {17, kIgnore, 0, 5, 11, kVocab + 40};  // the last clamped to V - 1
  std::vector<T> lse(kRows, T(-1)), loss(kRows, T(-1)), scale(kRows);
  tempo::LinearCrossEntropyForwardParams f;
  f.dtype = dtype;
  f.rows = kRows;
  f.vocab = kVocab;
  f.labels = labels.data();
  f.ignore_index = kIgnore;
  f.smoothing = smoothing;
  f.logits = z.data();
  f.lse = lse.data();
  f.loss = loss.data();
  ASSERT_TRUE(tempo::linear_cross_entropy_forward_cpu(f).ok());

  // fp32: the row's sums in double, the result rounded to fp32 a few times; fp64: a few ulp.
  const long double tol = std::is_same_v<T, float> ? 4e-7L : 4e-15L;
  std::vector<long double> want_lse(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    long double mx = -std::numeric_limits<long double>::infinity(), sum = 0, zsum = 0;
    for (int64_t j = 0; j < kVocab; ++j) mx = std::max<long double>(mx, z[r * kVocab + j]);
    for (int64_t j = 0; j < kVocab; ++j) {
      sum += std::exp(static_cast<long double>(z[r * kVocab + j]) - mx);
      zsum += z[r * kVocab + j];
    }
    want_lse[r] = mx + std::log(sum);
    EXPECT_LE(std::fabs(lse[r] - want_lse[r]), tol * (std::fabs(want_lse[r]) + 1)) << r;
    if (labels[r] == kIgnore) {
      EXPECT_EQ(loss[r], T(0)) << r;
      continue;
    }
    const int64_t y = std::min<int64_t>(std::max<int64_t>(labels[r], 0), kVocab - 1);
    // the smoothed loss's mean term is -inf on the row of -inf logits: only without smoothing there
    if (r == 3 && smoothing > 0) {
      EXPECT_TRUE(std::isinf(loss[r]) || std::isnan(loss[r])) << loss[r];
      continue;
    }
    const long double zy = z[r * kVocab + y];
    // torch's cross_entropy: the mean term only with smoothing (a -inf logit leaves the loss finite)
    long double want = -(1 - smoothing) * (zy - want_lse[r]);
    if (smoothing > 0) want -= smoothing * (zsum / kVocab - want_lse[r]);
    EXPECT_LE(std::fabs(loss[r] - want), tol * (std::fabs(want_lse[r]) + std::fabs(zy) + 1) * 4) << r;
  }

  for (int64_t r = 0; r < kRows; ++r) scale[r] = labels[r] == kIgnore ? T(0) : static_cast<T>(0.25 + r);
  std::vector<T> g = z;
  tempo::LinearCrossEntropyBackwardParams b;
  static_cast<tempo::LinearCrossEntropyParams&>(b) = f;
  b.logits = g.data();
  b.lse = lse.data();
  b.scale = scale.data();
  ASSERT_TRUE(tempo::linear_cross_entropy_backward_cpu(b).ok());
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t y = std::min<int64_t>(std::max<int64_t>(labels[r], 0), kVocab - 1);
    for (int64_t j = 0; j < kVocab; ++j) {
      const long double p = std::exp(static_cast<long double>(z[r * kVocab + j]) - want_lse[r]);
      const long double want = scale[r] * (p - smoothing / kVocab - (j == y ? 1 - smoothing : 0.0));
      EXPECT_LE(std::fabs(g[r * kVocab + j] - want), tol * 8 * std::fabs(static_cast<long double>(scale[r])) + 1e-30L)
          << r << "," << j;
    }
  }
}

TEST(LinearCrossEntropyCore, Fp32AgainstLongDouble) {
  check<float>(0.0);
  check<float>(0.1);
}

TEST(LinearCrossEntropyCore, Fp64AgainstLongDouble) {
  check<double>(0.0);
  check<double>(0.1);
}

TEST(LinearCrossEntropyCore, ParametersABackendWouldMisreadAreRefused) {
  std::vector<float> z(kVocab), lse(1), loss(1);
  const int64_t label = 3;
  tempo::LinearCrossEntropyForwardParams f;
  f.rows = 1;
  f.vocab = kVocab;
  f.labels = &label;
  f.logits = z.data();
  f.lse = lse.data();
  f.loss = loss.data();
  ASSERT_TRUE(tempo::linear_cross_entropy_forward_cpu(f).ok());
  auto bad = f;
  bad.vocab = 0;
  EXPECT_FALSE(tempo::linear_cross_entropy_forward_cpu(bad).ok());
  bad = f;
  bad.smoothing = 1.5;
  EXPECT_FALSE(tempo::linear_cross_entropy_forward_cpu(bad).ok());
  bad = f;
  bad.labels = nullptr;
  EXPECT_FALSE(tempo::linear_cross_entropy_forward_cpu(bad).ok());
  bad = f;
  bad.dtype = static_cast<tempo::DType>(99);
  EXPECT_FALSE(tempo::linear_cross_entropy_forward_cpu(bad).ok());
}

}  // namespace
