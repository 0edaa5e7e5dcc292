// Schemas, kernels and C++ API of tempo::causal_linear_attention (SLiM's chunk op). The
// kernels are device-generic (CompositeExplicitAutograd); Meta tensors get shapes only.
#include "tempo/ops/linear_attention.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common.h"
#include "dtype.h"
#include "tempo/linear_attention.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def(
      "causal_linear_attention(Tensor qf, Tensor kf, Tensor v, Tensor? num=None, Tensor? den=None, "
      "float eps=1e-6) -> (Tensor, Tensor, Tensor)");
  m.def(
      "causal_linear_attention_prefix(Tensor qf, Tensor kf, Tensor v, Tensor? num=None, Tensor? den=None, "
      "float eps=1e-6) -> (Tensor, Tensor, Tensor)");
  m.def(
      "causal_linear_attention_forward(Tensor qf, Tensor kf, Tensor v, Tensor? num, Tensor? den, float eps) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "causal_linear_attention_backward(Tensor grad_y, Tensor? grad_num, Tensor? grad_den, Tensor qf, Tensor kf, "
      "Tensor v, Tensor? num, Tensor? den, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

namespace tempo {
namespace {
using namespace torch_impl;

// The core's view of the shapes (concrete tensors only).
struct Shape {
  int64_t rows = 0, len = 0, m = 0, d = 0;
};

c10::ScalarType state_type(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Leading dims of q followed by `tail` (symbolic sizes allowed, for Meta / fake tensors).
c10::SymDimVector state_shape(const at::Tensor& q, std::initializer_list<c10::SymInt> tail) {
  c10::SymDimVector out(q.sym_sizes().begin(), q.sym_sizes().end() - 2);
  out.insert(out.end(), tail.begin(), tail.end());
  return out;
}

// Checks qf, kf, v and the state (with symbolic sizes where they are).
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& num,
                  const std::optional<at::Tensor>& den, double eps, const char* op) {
  check_floating(q, op, "qf");
  check_device(q, op, "qf");
  check_like(k, q, op, "kf");
  check_like(v, q, op, "v");
  TORCH_CHECK(q.dim() >= 2, op, ": argument 'qf' must have at least 2 dims [..., C, M], got ", q.dim());
  TORCH_CHECK(k.sym_sizes() == q.sym_sizes(), op, ": argument 'kf' must have qf's shape ", q.sym_sizes(), ", got ",
              k.sym_sizes());
  TORCH_CHECK(v.dim() == q.dim() && v.sym_sizes().slice(0, q.dim() - 1) == q.sym_sizes().slice(0, q.dim() - 1), op,
              ": argument 'v' must be [..., C, D] with qf's leading dims and C ", q.sym_sizes().slice(0, q.dim() - 1),
              ", got ", v.sym_sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(q.sym_size(-1) > 0 && v.sym_size(-1) > 0, op,
              ": the feature size M and the value size D must be positive");
  const bool has_num = num.has_value() && num->defined(), has_den = den.has_value() && den->defined();
  TORCH_CHECK(has_num == has_den, op, ": num and den come together (both or neither)");
  if (has_num) {
    const auto ns = state_shape(q, {q.sym_size(-1), v.sym_size(-1)}), ds = state_shape(q, {q.sym_size(-1)});
    TORCH_CHECK(num->sym_sizes() == c10::SymIntArrayRef(ns), op,
                ": argument 'num' must be [..., M, D] = ", c10::SymIntArrayRef(ns), ", got ", num->sym_sizes());
    TORCH_CHECK(den->sym_sizes() == c10::SymIntArrayRef(ds), op,
                ": argument 'den' must be [..., M] = ", c10::SymIntArrayRef(ds), ", got ", den->sym_sizes());
    for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&*num, "num"}, {&*den, "den"}}) {
      TORCH_CHECK(t->scalar_type() == state_type(q), op, ": argument '", name, "' (the state) must be ", state_type(q),
                  " for ", q.scalar_type(), " data, got ", t->scalar_type());
      TORCH_CHECK(t->device() == q.device(), op, ": argument '", name, "' (the state) must be on qf's device ",
                  q.device(), ", got ", t->device());
    }
  }
}

Shape concrete_shape(const at::Tensor& q, const at::Tensor& v) {
  Shape s;
  s.len = q.size(-2);
  s.m = q.size(-1);
  s.d = v.size(-1);
  s.rows = 1;
  for (int64_t i = 0; i + 2 < q.dim(); ++i) s.rows *= q.size(i);
  return s;
}

// The contiguous inputs the core reads, kept alive for the call, and the core's view of them
// (with the CUDA kernels' workspace).
struct CoreInputs {
  at::Tensor q, k, v, num, den, workspace;
};
CoreInputs core_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& num, const std::optional<at::Tensor>& den, double eps,
                       bool backward, LinearAttentionInputs* p) {
  CoreInputs in{q.contiguous(), k.contiguous(), v.contiguous(), {}, {}, {}};
  const Shape s = concrete_shape(q, v);
  p->dtype = to_core_dtype(q.scalar_type());
  p->q = in.q.const_data_ptr();
  p->k = in.k.const_data_ptr();
  p->v = in.v.const_data_ptr();
  if (num.has_value() && num->defined()) {
    in.num = num->contiguous();
    in.den = den->contiguous();
    p->num_in = in.num.const_data_ptr();
    p->den_in = in.den.const_data_ptr();
  }
  p->rows = s.rows;
  p->len = s.len;
  p->m = s.m;
  p->d = s.d;
  p->eps = eps;
  if (q.is_cuda()) {
    in.workspace =
        at::empty({linear_attention_workspace_bytes(s.rows, s.m, s.d, backward)}, q.options().dtype(at::kByte));
    p->workspace = in.workspace.mutable_data_ptr();
  }
  return in;
}

at::Tensor empty_state(const at::Tensor& q, c10::SymDimVector shape) {
  return at::empty_symint(shape, q.options().dtype(state_type(q)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_kernel(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const std::optional<at::Tensor>& num,
                                                              const std::optional<at::Tensor>& den, double eps) {
  const char* op = "tempo::causal_linear_attention";
  check_inputs(q, k, v, num, den, eps, op);
  at::Tensor y = at::empty_like(v, at::MemoryFormat::Contiguous);
  at::Tensor num_out = empty_state(q, state_shape(q, {q.sym_size(-1), v.sym_size(-1)}));
  at::Tensor den_out = empty_state(q, state_shape(q, {q.sym_size(-1)}));
  if (q.is_meta()) return {y, num_out, den_out};
  const Shape s = concrete_shape(q, v);
  if (s.rows == 0) return {y, num_out, den_out};
  c10::OptionalDeviceGuard guard(q.device());
  LinearAttentionForwardParams p;
  const CoreInputs in = core_inputs(q, k, v, num, den, eps, /*backward=*/false, &p);
  p.y = y.mutable_data_ptr();
  p.num_out = num_out.mutable_data_ptr();
  p.den_out = den_out.mutable_data_ptr();
  run_core(q, p, linear_attention_forward_cpu, linear_attention_forward_cuda, op);
  return {y, num_out, den_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_kernel(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_num, const std::optional<at::Tensor>& grad_den,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& num,
    const std::optional<at::Tensor>& den, double eps) {
  const char* op = "tempo::causal_linear_attention_backward";
  check_inputs(q, k, v, num, den, eps, op);
  check_like(grad_y, v, op, "grad_y");
  TORCH_CHECK(grad_y.sym_sizes() == v.sym_sizes(), op, ": argument 'grad_y' must have v's shape ", v.sym_sizes(),
              ", got ", grad_y.sym_sizes());
  const bool has_state = num.has_value() && num->defined();
  const auto ns = state_shape(q, {q.sym_size(-1), v.sym_size(-1)}), ds = state_shape(q, {q.sym_size(-1)});
  for (const auto* g : {&grad_num, &grad_den}) {
    if (g->has_value() && (*g)->defined()) {
      const at::Tensor& t = **g;
      const auto& want = g == &grad_num ? ns : ds;
      TORCH_CHECK(
          t.scalar_type() == state_type(q) && t.device() == q.device() && t.sym_sizes() == c10::SymIntArrayRef(want),
          op, ": argument '", g == &grad_num ? "grad_num" : "grad_den", "' must be like the state (", state_type(q),
          " ", c10::SymIntArrayRef(want), " on ", q.device(), "), got ", t.scalar_type(), " ", t.sym_sizes(), " on ",
          t.device());
    }
  }
  at::Tensor gq = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor gk = at::empty_like(k, at::MemoryFormat::Contiguous);
  at::Tensor gv = at::empty_like(v, at::MemoryFormat::Contiguous);
  at::Tensor gnum = empty_state(q, ns);
  at::Tensor gden = empty_state(q, ds);
  auto result = [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    if (!has_state) return {gq, gk, gv, at::Tensor(), at::Tensor()};
    return {gq, gk, gv, gnum, gden};
  };
  if (q.is_meta()) return result();
  const Shape s = concrete_shape(q, v);
  if (s.rows == 0) return result();
  c10::OptionalDeviceGuard guard(q.device());
  LinearAttentionBackwardParams p;
  const CoreInputs in = core_inputs(q, k, v, num, den, eps, /*backward=*/true, &p);
  const at::Tensor gyc = grad_y.contiguous();
  at::Tensor gnc, gdc;
  p.grad_y = gyc.const_data_ptr();
  if (grad_num.has_value() && grad_num->defined()) {
    gnc = grad_num->contiguous();
    p.grad_num_out = gnc.const_data_ptr();
  }
  if (grad_den.has_value() && grad_den->defined()) {
    gdc = grad_den->contiguous();
    p.grad_den_out = gdc.const_data_ptr();
  }
  p.grad_q = gq.mutable_data_ptr();
  p.grad_k = gk.mutable_data_ptr();
  p.grad_v = gv.mutable_data_ptr();
  p.grad_num_in = gnum.mutable_data_ptr();
  p.grad_den_in = gden.mutable_data_ptr();
  run_core(q, p, linear_attention_backward_cpu, linear_attention_backward_cuda, op);
  return result();
}

// Below autograd (or in inference): the forward alone.
std::tuple<at::Tensor, at::Tensor, at::Tensor> no_grad_kernel(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const std::optional<at::Tensor>& num,
                                                              const std::optional<at::Tensor>& den, double eps) {
  return forward_kernel(q, k, v, num, den, eps);
}

// The prefix-sum mode in torch ops (tempo::causal_linear_attention_prefix): S_l = num + cumsum_l(k_l v_l^T), z_l = den
// + cumsum_l(k_l).
std::tuple<at::Tensor, at::Tensor, at::Tensor> prefix_sum(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const std::optional<at::Tensor>& num,
                                                          const std::optional<at::Tensor>& den, double eps) {
  const char* op = "tempo::causal_linear_attention";
  check_inputs(q, k, v, num, den, eps, op);
  const auto st = state_type(q);
  const at::Tensor qs = q.to(st), ks = k.to(st), vs = v.to(st);
  at::Tensor S = at::cumsum(ks.unsqueeze(-1) * vs.unsqueeze(-2), -3);  // [..., C, M, D]
  at::Tensor z = at::cumsum(ks, -2);                                   // [..., C, M]
  const bool has_state = num.has_value() && num->defined();
  if (has_state) {
    S = S + num->unsqueeze(-3);
    z = z + den->unsqueeze(-2);
  }
  at::Tensor n = at::matmul(qs.unsqueeze(-2), S).squeeze(-2);  // [..., C, D]
  at::Tensor d = (qs * z).sum(-1, true) + eps;
  at::Tensor y = (n / d).to(q.scalar_type());
  at::Tensor num_out, den_out;
  if (q.sym_size(-2) > 0) {
    num_out = S.select(-3, -1);
    den_out = z.select(-2, -1);
  } else {
    num_out =
        has_state ? *num : at::zeros_symint(state_shape(q, {q.sym_size(-1), v.sym_size(-1)}), q.options().dtype(st));
    den_out = has_state ? *den : at::zeros_symint(state_shape(q, {q.sym_size(-1)}), q.options().dtype(st));
  }
  return {y, num_out, den_out};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_linear_attention(const at::Tensor& qf, const at::Tensor& kf,
                                                                       const at::Tensor& v,
                                                                       const std::optional<at::Tensor>& num,
                                                                       const std::optional<at::Tensor>& den, double eps,
                                                                       c10::string_view mode) {
  TORCH_CHECK(mode == "iterative" || mode == "prefix",
              "tempo::causal_linear_attention: mode must be 'iterative' or 'prefix', got '", std::string(mode), "'");
  if (mode == "prefix") {
    static const auto prefix = op_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
        const std::optional<at::Tensor>&, double)>("tempo::causal_linear_attention_prefix");
    return prefix.call(qf, kf, v, num, den, eps);
  }
  static const auto op = op_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, double)>("tempo::causal_linear_attention");
  return op.call(qf, kf, v, num, den, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_linear_attention_forward(
    const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& v, const std::optional<at::Tensor>& num,
    const std::optional<at::Tensor>& den, double eps) {
  static const auto& op = op_for<&causal_linear_attention_forward>("tempo::causal_linear_attention_forward");
  return op.call(qf, kf, v, num, den, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_linear_attention_backward(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_num, const std::optional<at::Tensor>& grad_den,
    const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& v, const std::optional<at::Tensor>& num,
    const std::optional<at::Tensor>& den, double eps) {
  static const auto& op = op_for<&causal_linear_attention_backward>("tempo::causal_linear_attention_backward");
  return op.call(grad_y, grad_num, grad_den, qf, kf, v, num, den, eps);
}

}  // namespace tempo

// The prefix-sum mode decomposes into torch ops: autograd differentiates those.
TORCH_LIBRARY_IMPL(tempo, CompositeImplicitAutograd, m) { m.impl("causal_linear_attention_prefix", tempo::prefix_sum); }

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("causal_linear_attention", tempo::no_grad_kernel);
  m.impl("causal_linear_attention_forward", tempo::forward_kernel);
  m.impl("causal_linear_attention_backward", tempo::backward_kernel);
}
