// Kernel-core tests of the rotary embedding, without LibTorch: forward and backward against a
// scalar loop in long double over x cos + rotate_half(x) sin (and its transpose), for x read
// through strides (a transposed q), a table per batch row or one shared, a partial rotary_dim;
// fp32 and fp64 within one rounding of the exact value plus the math type's two products, bf16
// data with float32 tables within one bf16 rounding; parameters a backend would misread refused.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "math/numeric.h"
#include "tempo/rope.h"

namespace {

constexpr int64_t B = 2, H = 3, S = 5, D = 10;

struct Case {
  int64_t rotary_dim, table_batch;
  bool transposed;  // x stored as [B, S, H, D] and read as [B, H, S, D]
};

// The exact value at (b, a, s, j) from x's values (long double), forward or transposed.
long double want(const std::vector<long double>& x, const std::vector<long double>& c,
                 const std::vector<long double>& sn, const Case& k, int64_t b, int64_t a, int64_t s, int64_t j,
                 bool backward) {
  const int64_t R = k.rotary_dim, h = R / 2;
  auto xi = [&](int64_t jj) { return x[((b * H + a) * S + s) * D + jj]; };
  const int64_t t = ((k.table_batch == 1 ? 0 : b) * S + s) * R;
  if (j >= R) return xi(j);
  if (!backward) return j < h ? xi(j) * c[t + j] - xi(j + h) * sn[t + j] : xi(j) * c[t + j] + xi(j - h) * sn[t + j];
  return j < h ? xi(j) * c[t + j] + xi(j + h) * sn[t + j + h] : xi(j) * c[t + j] - xi(j - h) * sn[t + j - h];
}

template <typename T, typename C>
void check(const Case& k, bool backward) {
  using A = tempo::math::acc_t<T>;
  const auto dt = [](auto v) {
    using V = decltype(v);
    return std::is_same_v<V, float>    ? tempo::DType::kFloat32
           : std::is_same_v<V, double> ? tempo::DType::kFloat64
                                       : tempo::DType::kBFloat16;
  };
  std::mt19937 gen(static_cast<unsigned>(k.rotary_dim * 7 + k.table_batch + k.transposed));
  std::normal_distribution<double> nd;
  std::uniform_real_distribution<double> ang(-40.0, 40.0);
  const int64_t R = k.rotary_dim, n = B * H * S * D, tn = k.table_batch * S * R;
  std::vector<T> store(n), out(n);
  std::vector<long double> x(n);  // the values at the logical [B, H, S, D] index
  auto at = [&](int64_t b, int64_t a, int64_t s) {
    return k.transposed ? ((b * S + s) * H + a) * D : ((b * H + a) * S + s) * D;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < H; ++a)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t j = 0; j < D; ++j) {
          tempo::math::store(&store[at(b, a, s) + j], static_cast<A>(nd(gen)));
          x[((b * H + a) * S + s) * D + j] = tempo::math::to_float(store[at(b, a, s) + j]);
        }
  std::vector<C> cos(tn), sin(tn);
  std::vector<long double> cl(tn), sl(tn);
  for (int64_t i = 0; i < tn; ++i) {
    const double th = ang(gen);
    tempo::math::store(&cos[i], static_cast<tempo::math::acc_t<C>>(std::cos(th)));
    tempo::math::store(&sin[i], static_cast<tempo::math::acc_t<C>>(std::sin(th)));
    cl[i] = tempo::math::to_float(cos[i]);
    sl[i] = tempo::math::to_float(sin[i]);
  }
  tempo::RopeParams p;
  p.dtype = dt(T{});
  p.table_dtype = dt(C{});
  p.batch = B;
  p.heads = H;
  p.seq = S;
  p.head_dim = D;
  p.rotary_dim = R;
  p.table_batch = k.table_batch;
  p.x_stride_batch = k.transposed ? S * H * D : H * S * D;
  p.x_stride_head = k.transposed ? D : S * D;
  p.x_stride_seq = k.transposed ? H * D : D;
  p.out_stride_batch = H * S * D, p.out_stride_head = S * D, p.out_stride_seq = D;
  p.x = store.data();
  p.cos = cos.data();
  p.sin = sin.data();
  p.out = out.data();
  ASSERT_TRUE((backward ? tempo::rope_backward_cpu(p) : tempo::rope_forward_cpu(p)).ok());
  // one rounding to T of a value whose two products carry A's rounding each (|cos|, |sin| <= 1)
  const long double eps_t = std::numeric_limits<A>::epsilon() / (sizeof(T) == 2 ? 1.0L / 65536 : 1.0L);
  const long double eps_a = std::numeric_limits<A>::epsilon();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < H; ++a)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t j = 0; j < D; ++j) {
          const long double w = want(x, cl, sl, k, b, a, s, j, backward);
          const long double got = tempo::math::to_float(out[((b * H + a) * S + s) * D + j]);
          const int64_t h = R / 2, o = j < h ? j + h : j - h;
          const long double scale = std::fabs(x[((b * H + a) * S + s) * D + j]) +
                                    (j < R ? std::fabs(x[((b * H + a) * S + s) * D + o]) : 0.0L);
          const long double bound = std::fabs(w) * eps_t / 2 + 2 * scale * eps_a;
          ASSERT_LE(std::fabs(got - w), bound) << "b" << b << " a" << a << " s" << s << " j" << j << " R" << R;
          if (j >= R) ASSERT_EQ(got, w);  // passed through bitwise
        }
}

const Case kCases[] = {{10, 1, false}, {10, 2, true}, {6, 2, false}, {4, 1, true}, {0, 1, false}};

TEST(Rope, Fp32MatchesTheExactRotation) {
  for (const Case& k : kCases)
    for (bool bw : {false, true}) check<float, float>(k, bw);
}

TEST(Rope, Fp64MatchesTheExactRotation) {
  for (const Case& k : kCases)
    for (bool bw : {false, true}) check<double, double>(k, bw);
}

TEST(Rope, Bf16WithFloat32TablesIsOneRoundingFromExact) {
  for (const Case& k : kCases)
    for (bool bw : {false, true}) check<tempo::math::bf16_t, float>(k, bw);
}

TEST(Rope, BackwardIsTheTransposeOfTheForward) {
  // <rope(x), g> = <x, rope_backward(g)> for every x and g, in double: the adjoint identity
  std::mt19937 gen(3);
  std::normal_distribution<double> nd;
  const int64_t R = 8, n = B * H * S * D;
  std::vector<double> x(n), g(n), y(n), dx(n), cos(S * R), sin(S * R);
  for (auto* v : {&x, &g, &cos, &sin})
    for (auto& e : *v) e = nd(gen);  // tables not a rotation: the identity holds for any
  tempo::RopeParams p;
  p.dtype = p.table_dtype = tempo::DType::kFloat64;
  p.batch = B, p.heads = H, p.seq = S, p.head_dim = D, p.rotary_dim = R;
  p.x_stride_batch = p.out_stride_batch = H * S * D;
  p.x_stride_head = p.out_stride_head = S * D;
  p.x_stride_seq = p.out_stride_seq = D;
  p.cos = cos.data(), p.sin = sin.data();
  p.x = x.data(), p.out = y.data();
  ASSERT_TRUE(tempo::rope_forward_cpu(p).ok());
  p.x = g.data(), p.out = dx.data();
  ASSERT_TRUE(tempo::rope_backward_cpu(p).ok());
  long double lhs = 0, rhs = 0, mag = 0;
  for (int64_t i = 0; i < n; ++i) {
    lhs += static_cast<long double>(y[i]) * g[i];
    rhs += static_cast<long double>(x[i]) * dx[i];
    mag += std::fabs(static_cast<long double>(y[i]) * g[i]);
  }
  EXPECT_LE(std::fabs(lhs - rhs), mag * 1e-14L);
}

TEST(Rope, RefusesWhatABackendWouldMisread) {
  float buf[64] = {};
  tempo::RopeParams p;
  p.batch = 1, p.heads = 1, p.seq = 2, p.head_dim = 4, p.rotary_dim = 4;
  p.x_stride_batch = p.out_stride_batch = 8, p.x_stride_head = p.out_stride_head = 8;
  p.x_stride_seq = p.out_stride_seq = 4;
  p.x = p.cos = p.sin = buf;
  p.out = buf + 32;
  ASSERT_TRUE(tempo::rope_forward_cpu(p).ok());
  auto refused = [&](tempo::RopeParams q, const char* what) {
    const tempo::Status s = tempo::rope_forward_cpu(q);
    EXPECT_FALSE(s.ok()) << "accepted " << what;
    EXPECT_NE(s.message().find("rope"), std::string::npos) << s.message();
  };
  auto q = p;
  q.rotary_dim = 3;
  refused(q, "an odd rotary_dim");
  q = p, q.rotary_dim = 6;
  refused(q, "rotary_dim over head_dim");
  q = p, q.table_batch = 2;
  refused(q, "a table batch that is neither 1 nor x's");
  q = p, q.seq = -1;
  refused(q, "a negative size");
  q = p, q.x_stride_seq = -4;
  refused(q, "a negative stride");
  q = p, q.out_stride_head = -8;
  refused(q, "a negative output stride");
  q = p, q.sin = nullptr;
  refused(q, "a null table");
  q = p, q.dtype = tempo::DType::kFloat64;
  refused(q, "float32 tables for float64 x");
  q = p, q.dtype = static_cast<tempo::DType>(99);
  refused(q, "an unknown dtype");
  q = p, q.batch = q.heads = q.seq = int64_t{1} << 40;
  refused(q, "sizes whose element count overflows");
}

}  // namespace
