// CPU kernels of causal linear attention: one row (batch x head) per work item over OpenMP
// threads; the running sums S (m x d) and z (m) in double, whatever the data type, so that
// the backward's subtraction rebuilds every S_l to within double rounding of the total.
#include "tempo/linear_attention.h"

#include <vector>

#include "../math/numeric.h"
#include "dispatch.h"

namespace tempo {
namespace {

template <typename T>
using state_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
void load_row(const T* src, int64_t n, double* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(math::to_float(src[i]));
}

// The state before the chunk (or zeros) into the running sums S, z.
template <typename T>
void load_state(const LinearAttentionInputs& p, int64_t r, std::vector<double>& S, std::vector<double>& z) {
  using St = state_t<T>;
  if (p.num_in) {
    load_row(static_cast<const St*>(p.num_in) + r * p.m * p.d, p.m * p.d, S.data());
    load_row(static_cast<const St*>(p.den_in) + r * p.m, p.m, z.data());
  } else {
    std::fill(S.begin(), S.end(), 0.0);
    std::fill(z.begin(), z.end(), 0.0);
  }
}

template <typename T>
void forward_row(const LinearAttentionForwardParams& p, int64_t r, std::vector<double>& S, std::vector<double>& z,
                 std::vector<double>& ql, std::vector<double>& kl, std::vector<double>& vl) {
  using St = state_t<T>;
  const int64_t m = p.m, d = p.d;
  const T* q = static_cast<const T*>(p.q) + r * p.len * m;
  const T* k = static_cast<const T*>(p.k) + r * p.len * m;
  const T* v = static_cast<const T*>(p.v) + r * p.len * d;
  T* y = static_cast<T*>(p.y) + r * p.len * d;
  load_state<T>(p, r, S, z);
  std::vector<double> n(d);
  for (int64_t l = 0; l < p.len; ++l) {
    load_row(q + l * m, m, ql.data());
    load_row(k + l * m, m, kl.data());
    load_row(v + l * d, d, vl.data());
    double den = p.eps;
    std::fill(n.begin(), n.end(), 0.0);
    for (int64_t i = 0; i < m; ++i) {
      z[i] += kl[i];
      den += z[i] * ql[i];
      double* Si = S.data() + i * d;
      const double ki = kl[i], qi = ql[i];
      for (int64_t j = 0; j < d; ++j) {
        Si[j] += ki * vl[j];
        n[j] += Si[j] * qi;
      }
    }
    for (int64_t j = 0; j < d; ++j) math::store(y + l * d + j, static_cast<math::acc_t<T>>(n[j] / den));
  }
  St* num_out = static_cast<St*>(p.num_out) + r * m * d;
  St* den_out = static_cast<St*>(p.den_out) + r * m;
  for (int64_t i = 0; i < m * d; ++i) num_out[i] = static_cast<St>(S[i]);
  for (int64_t i = 0; i < m; ++i) den_out[i] = static_cast<St>(z[i]);
}

template <typename T>
void backward_row(const LinearAttentionBackwardParams& p, int64_t r, std::vector<double>& S, std::vector<double>& z,
                  std::vector<double>& G, std::vector<double>& H, std::vector<double>& ql, std::vector<double>& kl,
                  std::vector<double>& vl, std::vector<double>& gy) {
  using St = state_t<T>;
  const int64_t m = p.m, d = p.d;
  const T* q = static_cast<const T*>(p.q) + r * p.len * m;
  const T* k = static_cast<const T*>(p.k) + r * p.len * m;
  const T* v = static_cast<const T*>(p.v) + r * p.len * d;
  const T* dy = static_cast<const T*>(p.grad_y) + r * p.len * d;
  T* gq = static_cast<T*>(p.grad_q) + r * p.len * m;
  T* gk = static_cast<T*>(p.grad_k) + r * p.len * m;
  T* gv = static_cast<T*>(p.grad_v) + r * p.len * d;
  // The sums after the chunk, again from the state in (the forward's rounded state out would
  // bring its rounding into every S_l rebuilt from it).
  load_state<T>(p, r, S, z);
  for (int64_t l = 0; l < p.len; ++l) {
    load_row(k + l * m, m, kl.data());
    load_row(v + l * d, d, vl.data());
    for (int64_t i = 0; i < m; ++i) {
      z[i] += kl[i];
      for (int64_t j = 0; j < d; ++j) S[i * d + j] += kl[i] * vl[j];
    }
  }
  if (p.grad_num_out)
    load_row(static_cast<const St*>(p.grad_num_out) + r * m * d, m * d, G.data());
  else
    std::fill(G.begin(), G.end(), 0.0);
  if (p.grad_den_out)
    load_row(static_cast<const St*>(p.grad_den_out) + r * m, m, H.data());
  else
    std::fill(H.begin(), H.end(), 0.0);
  std::vector<double> n(d), gn(d), gqv(m);
  for (int64_t l = p.len - 1; l >= 0; --l) {
    load_row(q + l * m, m, ql.data());
    load_row(k + l * m, m, kl.data());
    load_row(v + l * d, d, vl.data());
    load_row(dy + l * d, d, gy.data());
    // y_l = n / D with n = S_l^T q_l, D = z_l . q_l + eps.
    double D = p.eps;
    std::fill(n.begin(), n.end(), 0.0);
    for (int64_t i = 0; i < m; ++i) {
      D += z[i] * ql[i];
      const double* Si = S.data() + i * d;
      for (int64_t j = 0; j < d; ++j) n[j] += Si[j] * ql[i];
    }
    double gyn = 0.0;
    for (int64_t j = 0; j < d; ++j) {
      gn[j] = gy[j] / D;
      gyn += gy[j] * n[j];
    }
    const double gD = -gyn / (D * D);
    // dq = S_l dn + z_l dD; then G, H take position l's terms (they hold the gradients of
    // S_l and z_l); dk = G v + H, dv = G^T k; then S_{l-1} = S_l - k v^T, z_{l-1} = z_l - k.
    for (int64_t i = 0; i < m; ++i) {
      const double* Si = S.data() + i * d;
      double a = z[i] * gD;
      for (int64_t j = 0; j < d; ++j) a += Si[j] * gn[j];
      gqv[i] = a;
    }
    for (int64_t j = 0; j < d; ++j) n[j] = 0.0;  // reused: dv
    for (int64_t i = 0; i < m; ++i) {
      double* Gi = G.data() + i * d;
      double* Si = S.data() + i * d;
      const double qi = ql[i], ki = kl[i];
      H[i] += qi * gD;
      double a = H[i];
      for (int64_t j = 0; j < d; ++j) {
        Gi[j] += qi * gn[j];
        a += Gi[j] * vl[j];
        n[j] += Gi[j] * ki;
        Si[j] -= ki * vl[j];
      }
      z[i] -= ki;
      math::store(gk + l * m + i, static_cast<math::acc_t<T>>(a));
      math::store(gq + l * m + i, static_cast<math::acc_t<T>>(gqv[i]));
    }
    for (int64_t j = 0; j < d; ++j) math::store(gv + l * d + j, static_cast<math::acc_t<T>>(n[j]));
  }
  St* gnum = static_cast<St*>(p.grad_num_in) + r * m * d;
  St* gden = static_cast<St*>(p.grad_den_in) + r * m;
  for (int64_t i = 0; i < m * d; ++i) gnum[i] = static_cast<St>(G[i]);
  for (int64_t i = 0; i < m; ++i) gden[i] = static_cast<St>(H[i]);
}

bool parallel(int64_t rows, int64_t len, int64_t m, int64_t d) {
  return rows > 1 && rows * len * m * d >= cpu::kParallelMinElems;
}

}  // namespace

Status linear_attention_forward_cpu(const LinearAttentionForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
#pragma omp parallel if (parallel(p.rows, p.len, p.m, p.d))
    {
      std::vector<double> S(p.m * p.d), z(p.m), ql(p.m), kl(p.m), vl(p.d);
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < p.rows; ++r) forward_row<T>(p, r, S, z, ql, kl, vl);
    }
  });
  return Status::Ok();
}

Status linear_attention_backward_cpu(const LinearAttentionBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
#pragma omp parallel if (parallel(p.rows, p.len, p.m, p.d))
    {
      std::vector<double> S(p.m * p.d), z(p.m), G(p.m * p.d), H(p.m), ql(p.m), kl(p.m), vl(p.d), gy(p.d);
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < p.rows; ++r) backward_row<T>(p, r, S, z, G, H, ql, kl, vl, gy);
    }
  });
  return Status::Ok();
}

}  // namespace tempo
