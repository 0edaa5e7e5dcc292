// Kernel-core tests of causal linear attention, without LibTorch: the forward against the
// quadratic formula in a scalar double loop, the backward against central differences of a
// double loss, a sequence split into chunks with the state carried equal to one pass, and
// parameters that are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tempo/linear_attention.h"

namespace {

constexpr int64_t R = 3, L = 7, M = 4, D = 5;
constexpr double kEps = 1e-6;

struct Problem {
  std::vector<double> q, k, v, num0, den0, gy, gnum, gden;
  Problem()
      : q(R * L * M),
        k(R * L * M),
        v(R * L * D),
        num0(R * M * D),
        den0(R * M),
        gy(R * L * D),
        gnum(R * M * D),
        gden(R * M) {
    std::mt19937 gen(3);
    std::uniform_real_distribution<double> pos(0.05, 1.0);
    std::normal_distribution<double> nd;
    for (auto& x : q) x = pos(gen);
    for (auto& x : k) x = pos(gen);
    for (auto& x : v) x = nd(gen);
    for (auto& x : num0) x = nd(gen);
    for (auto& x : den0) x = 2 * pos(gen);
    for (auto& x : gy) x = nd(gen);
    for (auto& x : gnum) x = nd(gen);
    for (auto& x : gden) x = nd(gen);
  }
};

// y by the quadratic formula: y_l = (num0^T q_l + sum_{i<=l} (k_i . q_l) v_i) / (den0 . q_l + sum_{i<=l} k_i . q_l +
// eps).
std::vector<double> reference_y(const Problem& p) {
  std::vector<double> y(R * L * D);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t l = 0; l < L; ++l) {
      const double* ql = &p.q[(r * L + l) * M];
      double den = kEps;
      for (int64_t a = 0; a < M; ++a) den += p.den0[r * M + a] * ql[a];
      std::vector<double> n(D, 0.0);
      for (int64_t j = 0; j < D; ++j)
        for (int64_t a = 0; a < M; ++a) n[j] += p.num0[(r * M + a) * D + j] * ql[a];
      for (int64_t i = 0; i <= l; ++i) {
        double s = 0;
        for (int64_t a = 0; a < M; ++a) s += p.k[(r * L + i) * M + a] * ql[a];
        den += s;
        for (int64_t j = 0; j < D; ++j) n[j] += s * p.v[(r * L + i) * D + j];
      }
      for (int64_t j = 0; j < D; ++j) y[(r * L + l) * D + j] = n[j] / den;
    }
  return y;
}

struct Out {
  std::vector<double> y, num, den;
};

Out forward(const Problem& p, bool with_state, int64_t begin = 0, int64_t len = L, const double* num_in = nullptr,
            const double* den_in = nullptr) {
  // A chunk [begin, begin + len) of every row, copied contiguous.
  std::vector<double> q(R * len * M), k(R * len * M), v(R * len * D);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t l = 0; l < len; ++l) {
      for (int64_t a = 0; a < M; ++a) {
        q[(r * len + l) * M + a] = p.q[(r * L + begin + l) * M + a];
        k[(r * len + l) * M + a] = p.k[(r * L + begin + l) * M + a];
      }
      for (int64_t j = 0; j < D; ++j) v[(r * len + l) * D + j] = p.v[(r * L + begin + l) * D + j];
    }
  Out o{std::vector<double>(R * len * D), std::vector<double>(R * M * D), std::vector<double>(R * M)};
  tempo::LinearAttentionForwardParams f;
  f.dtype = tempo::DType::kFloat64;
  f.q = q.data();
  f.k = k.data();
  f.v = v.data();
  if (with_state) {
    f.num_in = num_in ? num_in : p.num0.data();
    f.den_in = den_in ? den_in : p.den0.data();
  }
  f.y = o.y.data();
  f.num_out = o.num.data();
  f.den_out = o.den.data();
  f.rows = R;
  f.len = len;
  f.m = M;
  f.d = D;
  f.eps = kEps;
  const tempo::Status s = tempo::linear_attention_forward_cpu(f);
  EXPECT_TRUE(s.ok()) << s.message();
  return o;
}

TEST(LinearAttentionCore, ForwardMatchesTheQuadraticFormula) {
  Problem p;
  const Out o = forward(p, true);
  const auto y = reference_y(p);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(o.y[i], y[i], 1e-12 * (1 + std::fabs(y[i]))) << i;
  // The state out is num0 + sum k v^T and den0 + sum k.
  for (int64_t r = 0; r < R; ++r)
    for (int64_t a = 0; a < M; ++a) {
      double z = p.den0[r * M + a];
      for (int64_t l = 0; l < L; ++l) z += p.k[(r * L + l) * M + a];
      EXPECT_NEAR(o.den[r * M + a], z, 1e-12);
      for (int64_t j = 0; j < D; ++j) {
        double s = p.num0[(r * M + a) * D + j];
        for (int64_t l = 0; l < L; ++l) s += p.k[(r * L + l) * M + a] * p.v[(r * L + l) * D + j];
        EXPECT_NEAR(o.num[(r * M + a) * D + j], s, 1e-12);
      }
    }
}

TEST(LinearAttentionCore, ChunksWithTheStateCarriedEqualOnePass) {
  Problem p;
  const Out whole = forward(p, true);
  const Out a = forward(p, true, 0, 3);
  const Out b = forward(p, true, 3, 4, a.num.data(), a.den.data());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t j = 0; j < D; ++j) {
        const double got = l < 3 ? a.y[(r * 3 + l) * D + j] : b.y[(r * 4 + l - 3) * D + j];
        EXPECT_NEAR(got, whole.y[(r * L + l) * D + j], 1e-12);
      }
  for (size_t i = 0; i < whole.num.size(); ++i) EXPECT_NEAR(b.num[i], whole.num[i], 1e-12);
}

// The loss sum(gy * y) + sum(gnum * num_out) + sum(gden * den_out), in double.
double loss(const Problem& p) {
  const Out o = forward(p, true);
  double s = 0;
  for (size_t i = 0; i < o.y.size(); ++i) s += p.gy[i] * o.y[i];
  for (size_t i = 0; i < o.num.size(); ++i) s += p.gnum[i] * o.num[i];
  for (size_t i = 0; i < o.den.size(); ++i) s += p.gden[i] * o.den[i];
  return s;
}

TEST(LinearAttentionCore, BackwardMatchesCentralDifferences) {
  Problem p;
  std::vector<double> gq(p.q.size()), gk(p.k.size()), gv(p.v.size()), gnum(p.num0.size()), gden(p.den0.size());
  tempo::LinearAttentionBackwardParams b;
  b.dtype = tempo::DType::kFloat64;
  b.q = p.q.data();
  b.k = p.k.data();
  b.v = p.v.data();
  b.num_in = p.num0.data();
  b.den_in = p.den0.data();
  b.grad_y = p.gy.data();
  b.grad_num_out = p.gnum.data();
  b.grad_den_out = p.gden.data();
  b.grad_q = gq.data();
  b.grad_k = gk.data();
  b.grad_v = gv.data();
  b.grad_num_in = gnum.data();
  b.grad_den_in = gden.data();
  b.rows = R;
  b.len = L;
  b.m = M;
  b.d = D;
  b.eps = kEps;
  const tempo::Status s = tempo::linear_attention_backward_cpu(b);
  ASSERT_TRUE(s.ok()) << s.message();
  auto check = [&](std::vector<double>& x, const std::vector<double>& g, const char* what) {
    for (size_t i = 0; i < x.size(); ++i) {
      const double h = 1e-6 * std::max(1.0, std::fabs(x[i])), x0 = x[i];
      x[i] = x0 + h;
      const double up = loss(p);
      x[i] = x0 - h;
      const double down = loss(p);
      x[i] = x0;
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(g[i], fd, 1e-6 * (1 + std::fabs(fd))) << what << " " << i;
    }
  };
  check(p.q, gq, "q");
  check(p.k, gk, "k");
  check(p.v, gv, "v");
  check(p.num0, gnum, "num_in");
  check(p.den0, gden, "den_in");
}

TEST(LinearAttentionCore, RefusesBadParameters) {
  Problem p;
  std::vector<double> y(R * L * D), num(R * M * D), den(R * M);
  tempo::LinearAttentionForwardParams f;
  f.dtype = tempo::DType::kFloat64;
  f.q = p.q.data();
  f.k = p.k.data();
  f.v = p.v.data();
  f.y = y.data();
  f.num_out = num.data();
  f.den_out = den.data();
  f.rows = R;
  f.len = L;
  f.m = M;
  f.d = D;
  EXPECT_TRUE(tempo::linear_attention_forward_cpu(f).ok());
  auto bad = f;
  bad.m = 0;
  EXPECT_NE(tempo::linear_attention_forward_cpu(bad).message().find("must be positive"), std::string::npos);
  bad = f;
  bad.eps = -1;
  EXPECT_NE(tempo::linear_attention_forward_cpu(bad).message().find("eps"), std::string::npos);
  bad = f;
  bad.num_in = p.num0.data();  // without den_in
  EXPECT_NE(tempo::linear_attention_forward_cpu(bad).message().find("both or neither"), std::string::npos);
  bad = f;
  bad.y = nullptr;
  EXPECT_FALSE(tempo::linear_attention_forward_cpu(bad).ok());
}

}  // namespace
