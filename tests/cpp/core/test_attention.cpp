// Kernel-core tests of the attention softmax, without LibTorch: forward (scale, additive
// mask, causal mask, dropout bits) and backward against scalar double loops; a block of rows
// reproduces the whole matrix; parameters a backend would misread are rejected.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "math/philox.h"
#include "tempo/attention.h"

namespace {

constexpr int64_t B = 2, H = 3, S = 5, C = 7;
constexpr double kP = 0.3, kScale = 0.4;

bool ref_keep(int64_t e) {
  const auto r = tempo::math::philox_group(11, 3, static_cast<uint64_t>(e / 4));
  return static_cast<double>(r.v[e % 4]) < std::floor((1.0 - kP) * 4294967296.0 + 0.5);
}

struct Problem {
  std::vector<double> scores, mask, grad;
  Problem() : scores(B * H * S * C), mask(S * C), grad(B * H * S * C) {
    std::mt19937 gen(5);
    std::normal_distribution<double> nd;
    for (auto& v : scores) v = 2 * nd(gen);
    for (auto& v : grad) v = nd(gen);
    for (int64_t e = 0; e < S * C; ++e) mask[e] = e % 5 == 0 ? -1.5 : 0.25;  // broadcast over B, H
  }
  // P of row r (b, h, i) in double, with the causal mask.
  std::vector<double> probs(int64_t r, bool causal) const {
    const int64_t i = r % S;
    std::vector<double> x(C), p(C);
    double mx = -std::numeric_limits<double>::infinity(), sum = 0;
    for (int64_t j = 0; j < C; ++j) {
      x[j] = causal && j > i ? -std::numeric_limits<double>::infinity() : scores[r * C + j] * kScale + mask[i * C + j];
      mx = std::max(mx, x[j]);
    }
    for (int64_t j = 0; j < C; ++j) sum += (p[j] = std::exp(x[j] - mx));
    for (auto& v : p) v /= sum;
    return p;
  }
};

tempo::AttentionSoftmaxForwardParams forward_params(std::vector<double>& s, std::vector<double>& dropped,
                                                    std::vector<uint8_t>& bits, const std::vector<float>& mask,
                                                    bool causal) {
  tempo::AttentionSoftmaxForwardParams f;
  f.dtype = tempo::DType::kFloat64;
  f.scores = s.data();
  f.dropped = dropped.data();
  f.mask_bits = bits.data();
  f.attn_mask = mask.data();
  f.mask_stride[2] = C;
  f.mask_stride[3] = 1;
  f.batch = B;
  f.heads = H;
  f.rows = S;
  f.cols = C;
  f.scale = kScale;
  f.causal = causal;
  f.p = kP;
  f.rng = {11, 3};
  return f;
}

TEST(AttentionCore, Float64MatchesScalarReference) {
  const Problem pr;
  const std::vector<float> mask(pr.mask.begin(), pr.mask.end());
  for (bool causal : {false, true}) {
    std::vector<double> s = pr.scores, dropped(s.size());
    std::vector<uint8_t> bits(tempo::bit_mask_bytes(B * H * S * C));
    ASSERT_TRUE(tempo::attention_softmax_forward_cpu(forward_params(s, dropped, bits, mask, causal)).ok());
    std::vector<double> g = pr.grad;
    tempo::AttentionSoftmaxBackwardParams b;
    b.dtype = tempo::DType::kFloat64;
    b.grad = g.data();
    b.probs = s.data();
    b.mask_bits = bits.data();
    b.batch = B;
    b.heads = H;
    b.rows = S;
    b.cols = C;
    b.scale = kScale;
    b.p = kP;
    ASSERT_TRUE(tempo::attention_softmax_backward_cpu(b).ok());
    for (int64_t r = 0; r < B * H * S; ++r) {
      const std::vector<double> p = pr.probs(r, causal);
      std::vector<double> dp(C);
      double dot = 0;
      for (int64_t j = 0; j < C; ++j) {
        const int64_t e = r * C + j;
        const bool keep = ref_keep(e);
        ASSERT_EQ(((bits[e / 8] >> (e % 8)) & 1) != 0, keep) << e;
        ASSERT_NEAR(s[e], p[j], 1e-14) << e;
        ASSERT_NEAR(dropped[e], keep ? p[j] / (1 - kP) : 0.0, 1e-13) << e;
        dp[j] = keep ? pr.grad[e] / (1 - kP) : 0.0;
        dot += dp[j] * p[j];
      }
      for (int64_t j = 0; j < C; ++j) ASSERT_NEAR(g[r * C + j], kScale * p[j] * (dp[j] - dot), 1e-13) << r << " " << j;
    }
  }
}

// Rows 2..4 of the matrix as a block (philox mode) give those rows of the whole matrix.
TEST(AttentionCore, BlockOfRowsReproducesTheMatrix) {
  const Problem pr;
  const std::vector<float> mask(pr.mask.begin(), pr.mask.end());
  std::vector<double> s = pr.scores, dropped(s.size());
  std::vector<uint8_t> bits(tempo::bit_mask_bytes(B * H * S * C));
  ASSERT_TRUE(tempo::attention_softmax_forward_cpu(forward_params(s, dropped, bits, mask, true)).ok());
  const int64_t r0 = 2, n = 3;
  std::vector<double> bs(B * H * n * C), bd(bs.size());
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < C; ++j) bs[(bh * n + i) * C + j] = pr.scores[(bh * S + r0 + i) * C + j];
  std::vector<uint8_t> none;
  tempo::AttentionSoftmaxForwardParams f = forward_params(bs, bd, none, mask, true);
  f.mask_bits = nullptr;
  f.mode = tempo::DropoutMode::kPhilox;
  f.rows = n;
  f.row_offset = r0;
  f.seq_q = S;
  ASSERT_TRUE(tempo::attention_softmax_forward_cpu(f).ok());
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < C; ++j) {
        ASSERT_EQ(bs[(bh * n + i) * C + j], s[(bh * S + r0 + i) * C + j]);
        ASSERT_EQ(bd[(bh * n + i) * C + j], dropped[(bh * S + r0 + i) * C + j]);
      }
}

TEST(AttentionCore, RejectsParametersABackendWouldMisread) {
  const Problem pr;
  const std::vector<float> mask(pr.mask.begin(), pr.mask.end());
  std::vector<double> s = pr.scores, dropped(s.size());
  std::vector<uint8_t> bits(tempo::bit_mask_bytes(B * H * S * C));
  tempo::AttentionSoftmaxForwardParams f = forward_params(s, dropped, bits, mask, false);
  f.row_offset = 1;  // a block of rows with packed bits
  f.seq_q = S + 1;
  EXPECT_FALSE(tempo::attention_softmax_forward_cpu(f).ok());
  f = forward_params(s, dropped, bits, mask, false);
  f.mode = tempo::DropoutMode::kPhilox;  // philox with a mask
  EXPECT_FALSE(tempo::attention_softmax_forward_cpu(f).ok());
  f = forward_params(s, dropped, bits, mask, false);
  f.mask_bits = nullptr;  // bits mode without the bits
  EXPECT_FALSE(tempo::attention_softmax_forward_cpu(f).ok());
  f.p = 1.5;
  EXPECT_FALSE(tempo::attention_softmax_forward_cpu(f).ok());
}

// A build without CUDA still has every CUDA entry point, and each says why it cannot run.
TEST(CoreBuild, CudaEntryPointsSayWhyWithoutCuda) {
  if (tempo::build_info().cuda_compiled) GTEST_SKIP() << "this build has the CUDA kernels";
  tempo::AttentionSoftmaxForwardParams f;
  const tempo::Status s = tempo::attention_softmax_forward_cuda(f, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "attention softmax forward: this build of tempo has no CUDA kernels");
  EXPECT_FALSE(tempo::attention_softmax_backward_cuda(tempo::AttentionSoftmaxBackwardParams{}, nullptr).ok());
  uint64_t state[2] = {0, 0};
  const tempo::Status store = tempo::philox_state_store_cuda(tempo::PhiloxState{}, state, nullptr);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.message(), "philox state store: this build of tempo has no CUDA kernels");
  EXPECT_FALSE(tempo::cuda_stream_capturing(nullptr));  // no CUDA: nothing is ever captured
}

}  // namespace
