// Kernel-core tests of qkv_split, without LibTorch: the forward writes z ([batch, seq, 3, heads,
// head_dim]) plus its bias as q, k and v ([batch, heads, seq, head_dim]), each element z + bias
// rounded once, against a scalar loop over the index arithmetic; the backward gathers dz back
// bitwise and sums the bias gradient in double (within half an ulp of the exact column sums);
// parameters a backend would misread are rejected.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "tempo/qkv_split.h"

namespace {

constexpr int64_t B = 2, S = 5, H = 3, D = 6, kCols = 3 * H * D;

// z's element (b, s, t, h, d) and the output's (b, h, s, d): the layouts qkv_split.h states
int64_t z_index(int64_t b, int64_t s, int64_t t, int64_t h, int64_t d) {
  return (((b * S + s) * 3 + t) * H + h) * D + d;
}
int64_t out_index(int64_t b, int64_t h, int64_t s, int64_t d) { return ((b * H + h) * S + s) * D + d; }

template <typename T>
void check(bool with_bias) {
  const auto dtype = std::is_same_v<T, float> ? tempo::DType::kFloat32 : tempo::DType::kFloat64;
  std::mt19937 gen(9);
  std::normal_distribution<double> nd;
  std::vector<T> z(B * S * kCols), bias(kCols), q(B * H * S * D, T(-7)), k(q), v(q);
  for (auto& x : z) x = static_cast<T>(nd(gen));
  for (auto& x : bias) x = static_cast<T>(nd(gen));
  tempo::QkvSplitForwardParams f;
  f.dtype = dtype;
  f.batch = B;
  f.seq = S;
  f.heads = H;
  f.head_dim = D;
  f.z = z.data();
  f.bias = with_bias ? bias.data() : nullptr;
  f.q = q.data();
  f.k = k.data();
  f.v = v.data();
  ASSERT_TRUE(tempo::qkv_split_forward_cpu(f).ok());
  std::vector<T>* outs[3] = {&q, &k, &v};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t t = 0; t < 3; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            const T want = with_bias ? static_cast<T>(z[z_index(b, s, t, h, d)] + bias[(t * H + h) * D + d])
                                     : z[z_index(b, s, t, h, d)];
            ASSERT_EQ((*outs[t])[out_index(b, h, s, d)], want) << b << s << t << h << d;
          }

  std::vector<T> gq(q.size()), gk(q.size()), gv(q.size()), gz(z.size(), T(-7)), gbias(kCols, T(-7));
  for (auto* g : {&gq, &gk, &gv})
    for (auto& x : *g) x = static_cast<T>(nd(gen));
  tempo::QkvSplitBackwardParams bw;
  static_cast<tempo::QkvSplitParams&>(bw) = f;
  bw.grad_q = gq.data();
  bw.grad_k = gk.data();
  bw.grad_v = gv.data();
  bw.grad_z = gz.data();
  bw.grad_bias = with_bias ? gbias.data() : nullptr;
  ASSERT_TRUE(tempo::qkv_split_backward_cpu(bw).ok());
  const std::vector<T>* grads[3] = {&gq, &gk, &gv};
  std::vector<long double> sums(kCols, 0.0L);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t t = 0; t < 3; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            const T g = (*grads[t])[out_index(b, h, s, d)];
            ASSERT_EQ(gz[z_index(b, s, t, h, d)], g);
            sums[(t * H + h) * D + d] += g;
          }
  if (with_bias) {
    for (int64_t c = 0; c < kCols; ++c) {
      const long double ulp =
          std::ldexp(1.0L, std::ilogb(static_cast<double>(sums[c])) - std::numeric_limits<T>::digits + 1);
      EXPECT_LE(std::fabs(gbias[c] - sums[c]), 0.5L * ulp + 1e-12L * std::fabs(sums[c])) << c;
    }
  } else {
    for (auto x : gbias) EXPECT_EQ(x, T(-7));  // not written
  }
}

TEST(QkvSplitCore, Fp32WithAndWithoutBiasAgainstTheLayouts) {
  check<float>(true);
  check<float>(false);
}

TEST(QkvSplitCore, Fp64WithAndWithoutBiasAgainstTheLayouts) {
  check<double>(true);
  check<double>(false);
}

TEST(QkvSplitCore, ParametersABackendWouldMisreadAreRefused) {
  std::vector<float> z(kCols), q(H * D), k(H * D), v(H * D);
  tempo::QkvSplitForwardParams f;
  f.batch = 1;
  f.seq = 1;
  f.heads = H;
  f.head_dim = D;
  f.z = z.data();
  f.q = q.data();
  f.k = k.data();
  f.v = v.data();
  ASSERT_TRUE(tempo::qkv_split_forward_cpu(f).ok());
  auto bad = f;
  bad.heads = -1;
  EXPECT_FALSE(tempo::qkv_split_forward_cpu(bad).ok());
  bad = f;
  bad.v = nullptr;
  EXPECT_FALSE(tempo::qkv_split_forward_cpu(bad).ok());
  bad = f;
  bad.dtype = static_cast<tempo::DType>(99);
  EXPECT_FALSE(tempo::qkv_split_forward_cpu(bad).ok());
  bad = f;
  bad.batch = std::numeric_limits<int64_t>::max() / 4;  // numel overflows
  EXPECT_FALSE(tempo::qkv_split_forward_cpu(bad).ok());
}

}  // namespace
