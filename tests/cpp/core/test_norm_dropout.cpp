// Kernel-core tests of dropout and the norms, without LibTorch: the Philox generator against
// the published known-answer vectors, dropout against its definition, and LayerNorm /
// RMSNorm (with the bias-dropout-residual prologue) against scalar double loops.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "math/philox.h"
#include "tempo/dropout.h"
#include "tempo/norm.h"

namespace {

using tempo::DType;

// Known-answer vectors of Philox-4x32-10 (Salmon et al., Random123 kat_vectors).
TEST(Philox, KnownAnswers) {
  auto r = tempo::math::philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = tempo::math::philox4x32_10(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  EXPECT_EQ(r.v[2], 0xa20bc7c6u);
  EXPECT_EQ(r.v[3], 0x6d5451fdu);
  r = tempo::math::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[1], 0x94fdccebu);
  EXPECT_EQ(r.v[2], 0x5001e420u);
  EXPECT_EQ(r.v[3], 0x24126ea1u);
}

// Element i is kept iff its Philox draw is below round((1 - p) 2^32).
bool ref_keep(uint64_t seed, uint64_t offset, int64_t i, double p) {
  const auto r = tempo::math::philox_group(seed, offset, static_cast<uint64_t>(i / 4));
  return static_cast<double>(r.v[i % 4]) < std::floor((1.0 - p) * 4294967296.0 + 0.5);
}

TEST(DropoutCore, ForwardBackwardMatchDefinition) {
  for (int64_t n : {1, 7, 8, 9, 4095, 100003}) {
    std::vector<float> x(n), y(n), g(n), gx(n), gx2(n);
    std::mt19937 gen(3);
    std::normal_distribution<float> nd;
    for (auto& v : x) v = nd(gen);
    for (auto& v : g) v = nd(gen);
    std::vector<uint8_t> mask(tempo::bit_mask_bytes(n));
    tempo::DropoutForwardParams f;
    f.x = x.data();
    f.y = y.data();
    f.mask = mask.data();
    f.p = 0.3;
    f.rng = {1234567, 89};
    f.numel = n;
    ASSERT_TRUE(tempo::dropout_forward_cpu(f).ok());
    tempo::DropoutBackwardParams b;
    b.grad_y = g.data();
    b.grad_x = gx.data();
    b.mask = mask.data();
    b.p = 0.3;
    b.numel = n;
    ASSERT_TRUE(tempo::dropout_backward_cpu(b).ok());
    b.mode = tempo::DropoutMode::kPhilox;  // regenerate
    b.mask = nullptr;
    b.rng = f.rng;
    b.grad_x = gx2.data();
    ASSERT_TRUE(tempo::dropout_backward_cpu(b).ok());
    for (int64_t i = 0; i < n; ++i) {
      const bool keep = ref_keep(1234567, 89, i, 0.3);
      ASSERT_EQ(((mask[i / 8] >> (i % 8)) & 1) != 0, keep) << i;
      ASSERT_EQ(y[i], keep ? static_cast<float>(x[i] / 0.7) : 0.0f) << i;
      ASSERT_EQ(gx[i], keep ? static_cast<float>(g[i] / 0.7) : 0.0f) << i;
      ASSERT_EQ(gx2[i], gx[i]) << i;
    }
    if (n % 8) ASSERT_EQ(mask.back() >> (n % 8), 0) << "bits past the end are zero";
  }
}

TEST(DropoutCore, ModeAndMaskMustAgree) {
  std::vector<float> x(16, 1.0f), y(16);
  std::vector<uint8_t> mask(2);
  tempo::DropoutForwardParams f;
  f.x = x.data();
  f.y = y.data();
  f.numel = 16;
  f.p = 0.5;
  EXPECT_FALSE(tempo::dropout_forward_cpu(f).ok());  // bits mode without the mask
  f.mode = tempo::DropoutMode::kPhilox;
  EXPECT_TRUE(tempo::dropout_forward_cpu(f).ok());
  f.mask = mask.data();
  EXPECT_FALSE(tempo::dropout_forward_cpu(f).ok());  // philox mode with a mask
  f.mode = tempo::DropoutMode::kBits;
  EXPECT_TRUE(tempo::dropout_forward_cpu(f).ok());
}

TEST(DropoutCore, RejectsBadProbability) {
  tempo::DropoutForwardParams f;
  f.p = 1.5;
  EXPECT_FALSE(tempo::dropout_forward_cpu(f).ok());
  f.p = -0.1;
  EXPECT_FALSE(tempo::dropout_forward_cpu(f).ok());
}

// LayerNorm(residual + dropout(x + bias)) and its gradients by scalar double loops.
struct Ref {
  std::vector<double> y, dx, dres, dw, db, dpb;
};
Ref reference(bool layer, int64_t R, int64_t M, const std::vector<double>& x, const std::vector<double>& res,
              const std::vector<double>& pb, const std::vector<double>& w, const std::vector<double>& b,
              const std::vector<double>& g, const std::vector<bool>& keep, double scale, bool prologue, double eps) {
  Ref o;
  o.y.resize(R * M);
  o.dx.resize(R * M);
  o.dres.resize(R * M);
  o.dw.assign(M, 0);
  o.db.assign(M, 0);
  o.dpb.assign(M, 0);
  for (int64_t r = 0; r < R; ++r) {
    std::vector<double> h(M), xh(M), gy(M);
    for (int64_t j = 0; j < M; ++j) {
      const int64_t e = r * M + j;
      h[j] = prologue ? res[e] + (keep[e] ? (x[e] + pb[j]) * scale : 0.0) : x[e];
    }
    double mean = 0, var = 0;
    if (layer) {
      for (double v : h) mean += v;
      mean /= M;
    }
    for (double v : h) var += (v - mean) * (v - mean);
    var /= M;
    const double rstd = 1 / std::sqrt(var + eps);
    double s1 = 0, s2 = 0;
    for (int64_t j = 0; j < M; ++j) {
      xh[j] = (h[j] - mean) * rstd;
      o.y[r * M + j] = xh[j] * w[j] + (layer ? b[j] : 0);
      gy[j] = g[r * M + j] * w[j];
      s1 += gy[j] * xh[j];
      s2 += gy[j];
    }
    for (int64_t j = 0; j < M; ++j) {
      const int64_t e = r * M + j;
      const double dh = rstd * (gy[j] - xh[j] * s1 / M - (layer ? s2 / M : 0));
      o.dres[e] = dh;
      o.dx[e] = prologue ? (keep[e] ? dh * scale : 0) : dh;
      o.dw[j] += g[e] * xh[j];
      o.db[j] += g[e];
      o.dpb[j] += o.dx[e];
    }
  }
  return o;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tol, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], tol * (1 + std::fabs(b[i]))) << what << " " << i;
}

// One fp64 norm problem (rows x cols, with the prologue or not): inputs, output buffers and
// the core's parameter structs pointing at them.
struct Fp64Norm {
  bool layer, prologue;
  int64_t R, M;
  double p;
  std::vector<double> x, res, g, pb, w, b;
  std::vector<double> y, rstd, xk, dx, dres, dw, db, dpb;
  std::vector<uint8_t> mask;
  std::vector<int32_t> slot;
  int64_t kept = 0;

  Fp64Norm(bool layer_, bool prologue_, int64_t R_, int64_t M_, unsigned seed)
      : layer(layer_),
        prologue(prologue_),
        R(R_),
        M(M_),
        p(prologue_ ? 0.25 : 0.0),
        x(R * M),
        res(R * M),
        g(R * M),
        pb(M),
        w(M),
        b(M),
        y(R * M),
        rstd(R),
        dx(R * M),
        dres(R * M),
        dw(M),
        db(M),
        dpb(M),
        mask(tempo::bit_mask_bytes(R * M)),
        slot(M, -1) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> nd;
    for (auto* v : {&x, &res, &g, &pb})
      for (auto& e : *v) e = nd(gen);
    for (int64_t j = 0; j < M; ++j) {
      w[j] = 1 + 0.3 * nd(gen);
      b[j] = 0.1 * nd(gen);
    }
  }
  // Keeps the columns the core's rule picks (for the current w, b).
  void keep_columns() {
    std::vector<int64_t> cols(M);
    kept = tempo::norm_kept_columns(DType::kFloat64, DType::kFloat64, w.data(), layer ? b.data() : nullptr, M,
                                    cols.data());
    for (int64_t i = 0; i < kept; ++i) slot[cols[i]] = static_cast<int32_t>(i);
    xk.assign(R * kept, 0.0);
  }
  Ref reference() const {
    std::vector<bool> keep(R * M);
    for (int64_t e = 0; e < R * M; ++e) keep[e] = ref_keep(42, 7, e, p);
    return ::reference(layer, R, M, x, res, pb, w, b, g, keep, 1 / (1 - p), prologue, 1e-5);
  }
  tempo::NormForwardParams forward() {
    tempo::NormForwardParams f;
    f.kind = layer ? tempo::NormKind::kLayerNorm : tempo::NormKind::kRmsNorm;
    f.dtype = DType::kFloat64;
    f.x = x.data();
    f.weight = w.data();
    f.beta = layer ? b.data() : nullptr;
    if (prologue) {
      f.prologue.residual = res.data();
      f.prologue.bias = pb.data();
      f.prologue.p = p;
      f.prologue.rng = {42, 7};
      f.mask = mask.data();
    }
    f.kept_slot = slot.data();
    f.kept = kept;
    f.kept_xhat = xk.data();
    f.y = y.data();
    f.rstd = rstd.data();
    f.rows = R;
    f.cols = M;
    f.eps = 1e-5;
    return f;
  }
  tempo::NormBackwardParams backward() {
    tempo::NormBackwardParams bp;
    bp.kind = layer ? tempo::NormKind::kLayerNorm : tempo::NormKind::kRmsNorm;
    bp.dtype = DType::kFloat64;
    bp.grad_y = g.data();
    bp.y = y.data();
    bp.rstd = rstd.data();
    bp.weight = w.data();
    bp.beta = layer ? b.data() : nullptr;
    bp.grad_x = dx.data();
    bp.grad_weight = dw.data();
    bp.grad_beta = db.data();
    if (prologue) {
      bp.prologue.p = p;
      bp.prologue.rng = {42, 7};
      bp.mask = mask.data();
      bp.grad_residual = dres.data();
      bp.grad_bias = dpb.data();
    }
    bp.kept_slot = slot.data();
    bp.kept = kept;
    bp.kept_xhat = xk.data();
    bp.rows = R;
    bp.cols = M;
    return bp;
  }
};

TEST(NormCore, Float64MatchesScalarReference) {
  for (bool layer : {true, false}) {
    for (bool prologue : {false, true}) {
      if (prologue && !layer) continue;
      for (int64_t M : {1, 7, 33, 1000}) {
        Fp64Norm n(layer, prologue, 13, M, 7);
        const Ref ref = n.reference();
        ASSERT_TRUE(tempo::norm_forward_cpu(n.forward()).ok());
        expect_close(n.y, ref.y, 1e-12, "y");
        tempo::NormBackwardParams bp = n.backward();
        ASSERT_TRUE(tempo::norm_backward_cpu(bp).ok());
        expect_close(n.dx, ref.dx, 1e-10, "dx");
        expect_close(n.dw, ref.dw, 1e-10, "dweight");
        if (layer) expect_close(n.db, ref.db, 1e-12, "dbias");
        if (prologue) {
          expect_close(n.dres, ref.dres, 1e-10, "dresidual");
          expect_close(n.dpb, ref.dpb, 1e-10, "dpre_bias");
          // philox mode: the same gradients from the regenerated mask
          std::vector<double> dx2(n.R * M);
          bp.mask = nullptr;
          bp.prologue.mode = tempo::DropoutMode::kPhilox;
          bp.grad_x = dx2.data();
          ASSERT_TRUE(tempo::norm_backward_cpu(bp).ok());
          EXPECT_EQ(dx2, n.dx);
        }
      }
    }
  }
}

TEST(NormCore, ColumnRule) {
  using tempo::norm_column_recoverable;
  EXPECT_TRUE(norm_column_recoverable(DType::kFloat32, 1.0, 16.0));
  EXPECT_FALSE(norm_column_recoverable(DType::kFloat32, 1.0, 16.5));
  EXPECT_TRUE(norm_column_recoverable(DType::kFloat32, -4.8e-33, 1e-32));  // MiniLM's tiny gammas: recoverable
  EXPECT_FALSE(norm_column_recoverable(DType::kFloat32, 1e-39, 0.0));      // subnormal in fp32
  EXPECT_TRUE(norm_column_recoverable(DType::kFloat64, 1e-39, 0.0));
  EXPECT_FALSE(norm_column_recoverable(DType::kFloat64, 0.0, 0.0));
  EXPECT_FALSE(norm_column_recoverable(DType::kFloat64, -0.0, 0.0));
  EXPECT_FALSE(norm_column_recoverable(DType::kFloat64, std::nan(""), 0.0));
  EXPECT_FALSE(norm_column_recoverable(DType::kFloat64, 1.0, INFINITY));
  EXPECT_FALSE(norm_column_recoverable(DType::kFloat16, 1e-5, 0.0));  // subnormal in fp16
  EXPECT_FALSE(norm_column_recoverable(DType::kBFloat16, 0.5, 0.6));
  EXPECT_TRUE(norm_column_recoverable(DType::kBFloat16, -0.5, 0.5));
  const std::vector<double> w{1.0, 0.0, 1e-300, 1e-3, -2.0}, b{0.0, 0.0, 0.0, 10.0, 1e3};
  std::vector<int64_t> out(5);
  ASSERT_EQ(tempo::norm_kept_columns(DType::kFloat64, DType::kFloat64, w.data(), b.data(), 5, out.data()), 2);
  EXPECT_EQ(out[0], 1);  // gamma 0
  EXPECT_EQ(out[1], 3);  // beta / gamma = 1e4 > 1024 (1e-300 is a normal double; 1e3 / 2 is within the ratio)
  // gamma 1, beta <= 1024
  EXPECT_EQ(tempo::norm_kept_columns(DType::kFloat64, DType::kFloat64, nullptr, b.data(), 5, out.data()), 0);
  const std::vector<float> bf{0.0f, 16.0f, -17.0f, 10.0f, 1e3f};
  // fp32: beta > 16
  ASSERT_EQ(tempo::norm_kept_columns(DType::kFloat32, DType::kFloat32, nullptr, bf.data(), 5, out.data()), 2);
  EXPECT_EQ(out[0], 2);
  EXPECT_EQ(out[1], 4);
  // float32 parameters over bfloat16 data: the data's rule (beta > gamma).
  ASSERT_EQ(tempo::norm_kept_columns(DType::kBFloat16, DType::kFloat32, nullptr, bf.data(), 5, out.data()), 4);
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(out[3], 4);
}

// Columns whose xhat cannot be recovered from y (gamma 0, gamma tiny against beta): exact
// against the scalar reference when kept, an error (not a wrong gradient) when not.
TEST(NormCore, KeptColumnsAreExact) {
  for (bool layer : {true, false}) {
    for (bool prologue : {false, true}) {
      if (prologue && !layer) continue;
      Fp64Norm n(layer, prologue, 9, 40, 11);
      if (!layer) std::fill(n.b.begin(), n.b.end(), 0.0);
      n.w[0] = 0.0;
      n.w[5] = -1e-310;  // subnormal
      n.w[17] = 1e-20;
      if (layer) {
        n.b[17] = 5.0;  // beta / gamma = 5e20
        n.w[30] = 1e-3;
        n.b[30] = -1e8;
      }
      n.keep_columns();
      ASSERT_EQ(n.kept, layer ? 4 : 2);  // 0, 5 (and 17, 30 with beta)
      const Ref ref = n.reference();
      ASSERT_TRUE(tempo::norm_forward_cpu(n.forward()).ok());
      expect_close(n.y, ref.y, 1e-12, "y");
      tempo::NormBackwardParams bp = n.backward();
      bp.kept = 0;
      const tempo::Status without = tempo::norm_backward_cpu(bp);
      EXPECT_FALSE(without.ok());
      EXPECT_NE(without.message().find("column 0"), std::string::npos) << without.message();
      ASSERT_TRUE(tempo::norm_backward_cpu(n.backward()).ok());
      expect_close(n.dx, ref.dx, 1e-10, "dx");
      expect_close(n.dw, ref.dw, 1e-10, "dweight");
      if (layer) expect_close(n.db, ref.db, 1e-12, "dbias");
      if (prologue) expect_close(n.dres, ref.dres, 1e-10, "dresidual");
    }
  }
}

TEST(NormCore, RejectsBadParameters) {
  tempo::NormForwardParams f;
  f.kind = tempo::NormKind::kRmsNorm;
  float v = 0;
  f.beta = &v;
  EXPECT_FALSE(tempo::norm_forward_cpu(f).ok());
  tempo::NormForwardParams g;
  g.rows = 1;
  g.cols = 1;
  EXPECT_FALSE(tempo::norm_forward_cpu(g).ok());  // null pointers
  // float32 parameters need 16-bit data.
  float x = 1, y = 0, r = 0, w = 1;
  tempo::NormForwardParams h;
  h.x = &x;
  h.y = &y;
  h.rstd = &r;
  h.weight = &w;
  h.rows = h.cols = 1;
  ASSERT_TRUE(tempo::norm_forward_cpu(h).ok());
  h.float_params = true;
  EXPECT_FALSE(tempo::norm_forward_cpu(h).ok());
  tempo::NormBackwardParams k;
  k.float_params = true;
  EXPECT_FALSE(tempo::norm_backward_cpu(k).ok());
}

}  // namespace
