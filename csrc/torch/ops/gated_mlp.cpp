// Schemas, kernels and C++ API of tempo::gated_mlp (tempo/ops/gated_mlp.h). The kernels are
// device-generic (CompositeExplicitAutograd): the projections are the framework's GEMMs (as
// F.linear runs them), the elementwise part is the core's kernel (tempo/gated_mlp.h), which
// reads the gate and up projections in place (strided, so one fused gate_up projection is not
// split into copies). On Meta and fake tensors they only allocate (torch.compile traces them).
#include "tempo/ops/gated_mlp.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "dtype.h"
#include "tempo/gated_mlp.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def(
      "gated_mlp(Tensor x, Tensor gate_weight, Tensor? up_weight, Tensor down_weight, Tensor? gate_bias=None, "
      "Tensor? up_bias=None, Tensor? down_bias=None, str activation='silu', int chunk=0, str recompute='product') -> "
      "Tensor");
  m.def(
      "gated_mlp_forward(Tensor x, Tensor gate_weight, Tensor? up_weight, Tensor down_weight, Tensor? gate_bias, "
      "Tensor? up_bias, Tensor? down_bias, str activation, str recompute='product') -> (Tensor, Tensor, Tensor)");
  m.def(
      "gated_mlp_backward(Tensor grad, Tensor x, Tensor? gate, Tensor? up, Tensor gate_weight, Tensor? up_weight, "
      "Tensor down_weight, Tensor? gate_bias, Tensor? up_bias, bool[3] bias_grad, str activation, int chunk, "
      "bool[4] output_mask) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

namespace tempo {
namespace {
using namespace torch_impl;
const char* kOp = "tempo::gated_mlp";

Activation activation_of(c10::string_view a) {
  if (a == "silu") return Activation::kSilu;
  if (a == "gelu") return Activation::kGeluErf;
  if (a == "gelu_tanh") return Activation::kGeluTanh;
  TORCH_CHECK(false, kOp, ": argument 'activation' must be 'silu', 'gelu' or 'gelu_tanh', got '", std::string(a), "'");
}

struct Shape {
  int64_t H, I, O;
  bool fused;  // one gate_up projection
  Activation act;
};

void check_vector(const at::Tensor* b, int64_t n, const at::Tensor& x, const char* arg) {
  if (!b) return;
  check_like(*b, x, kOp, arg);
  TORCH_CHECK(b->dim() == 1 && b->size(0) == n, kOp, ": argument '", arg, "' must have shape [", n, "], got ",
              b->sizes());
}

// Checks every argument against x; the sizes.
Shape check(const at::Tensor& x, const at::Tensor& gate_weight, const at::Tensor* up_weight,
            const at::Tensor& down_weight, const at::Tensor* gate_bias, const at::Tensor* up_bias,
            const at::Tensor* down_bias, c10::string_view activation) {
  check_floating(x, kOp, "x");
  check_device(x, kOp, "x");
  TORCH_CHECK(x.dim() >= 1, kOp, ": argument 'x' must be [..., H], got a scalar");
  const int64_t H = x.size(-1);
  TORCH_CHECK(H > 0, kOp, ": argument 'x' has an empty last dimension");
  check_like(gate_weight, x, kOp, "gate_weight");
  TORCH_CHECK(gate_weight.dim() == 2 && gate_weight.size(1) == H, kOp, ": argument 'gate_weight' must be [I, ", H, "]",
              up_weight ? "" : " (or [2 I, H] without up_weight)", " for x [..., ", H, "], got ", gate_weight.sizes());
  const bool fused = up_weight == nullptr;
  int64_t I = gate_weight.size(0);
  if (fused) {
    TORCH_CHECK(I % 2 == 0, kOp, ": without up_weight, argument 'gate_weight' is the fused gate_up projection [2 I, ",
                H, "] and needs an even number of rows, got ", I);
    I /= 2;
    TORCH_CHECK(!up_bias, kOp,
                ": argument 'up_bias' needs up_weight (a fused gate_up projection has one bias, "
                "gate_bias [2 I])");
  } else {
    check_like(*up_weight, x, kOp, "up_weight");
    TORCH_CHECK(up_weight->sizes() == gate_weight.sizes(), kOp, ": argument 'up_weight' must have gate_weight's shape ",
                gate_weight.sizes(), ", got ", up_weight->sizes());
  }
  TORCH_CHECK(I > 0, kOp, ": the intermediate width (gate_weight's rows) is 0");
  check_like(down_weight, x, kOp, "down_weight");
  TORCH_CHECK(down_weight.dim() == 2 && down_weight.size(1) == I, kOp, ": argument 'down_weight' must be [O, ", I,
              "] (I: the gate projection's outputs), got ", down_weight.sizes());
  check_vector(gate_bias, fused ? 2 * I : I, x, "gate_bias");
  check_vector(up_bias, I, x, "up_bias");
  check_vector(down_bias, down_weight.size(0), x, "down_bias");
  return {H, I, down_weight.size(0), fused, activation_of(activation)};
}

template <typename P>
void fill_gate_up(P& p, const Shape& s, const at::Tensor& g, const at::Tensor& u, int64_t rows) {
  p.act = s.act;
  p.dtype = to_core_dtype(g.scalar_type());
  p.gate = g.const_data_ptr();
  p.up = u.const_data_ptr();
  p.rows = rows;
  p.cols = g.size(1);
  p.gate_stride = g.stride(0);
  p.up_stride = u.stride(0);
}

std::vector<c10::SymInt> with_last(const at::Tensor& x, int64_t last) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = last;
  return shape;
}

// The blocks: the backward takes `chunk` intermediate columns at a time (0: H rounded up to a
// multiple of 64, so each block's GEMMs stay as wide as the model's own, N x H by H x block),
// the forward all I; both take rows in blocks of 2^20 / columns (at least 1024, so that each
// GEMM still reads its weights for many rows): the transients of a block (h, dh, dgate, dup,
// and gate and up where they are recomputed) then stay bounded whatever the sequence length,
// where blocks of all N rows would hold 4-6 x's worth (7 KB a token at H 256). Each
// weight-gradient block sums its row blocks' GEMMs in the math type (float32 for 16-bit data)
// and is rounded once.
int64_t columns_per_block(int64_t chunk, const Shape& s) {
  if (chunk > 0) return std::min(chunk, s.I);
  return std::min(s.I, (s.H + 63) / 64 * 64);
}
int64_t rows_per_block(int64_t columns) { return std::max<int64_t>(1024, (int64_t{1} << 20) / columns / 64 * 64); }

// A block of columns [c0, c0 + n) of the gate or up projection's output: the kept tensor's
// columns where the forward's output was kept, else recomputed from x (one GEMM, the forward's
// own for those rows of the weight).
at::Tensor block_of(const at::Tensor& kept, const at::Tensor& x2, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, int64_t row0, int64_t c0, int64_t n) {
  if (kept.defined()) return kept.narrow(1, c0, n);
  const std::optional<at::Tensor> b =
      bias.has_value() && bias->defined() ? std::optional<at::Tensor>(bias->narrow(0, row0 + c0, n)) : std::nullopt;
  return torch_impl::linear(x2, weight.narrow(0, row0 + c0, n), b);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_kernel(
    const at::Tensor& x, const at::Tensor& gate_weight, const std::optional<at::Tensor>& up_weight,
    const at::Tensor& down_weight, const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
    const std::optional<at::Tensor>& down_bias, c10::string_view activation, c10::string_view recompute) {
  const Shape s =
      check(x, gate_weight, get(up_weight), down_weight, get(gate_bias), get(up_bias), get(down_bias), activation);
  const GatedMlpRecompute what = gated_mlp_recompute(recompute);
  const bool keep_gate = what != GatedMlpRecompute::kGateUp, keep_up = what == GatedMlpRecompute::kProduct;
  const bool whole = s.fused && keep_up;  // the fused projection's [rows, 2 I] output kept as it is
  const c10::SymInt rows = x.sym_numel() / s.H;
  // an output not kept: empty, and a tensor of its own (outputs may not alias one another)
  auto none = [&] { return at::empty({0}, x.options()); };
  if (shapes_only(x)) {  // symbolic sizes (torch.compile): the outputs' shapes alone
    return {at::empty_symint(with_last(x, s.O), x.options()),
            keep_gate ? at::empty_symint({rows, c10::SymInt(whole ? 2 * s.I : s.I)}, x.options()) : none(),
            keep_up && !s.fused ? at::empty_symint({rows, c10::SymInt(s.I)}, x.options()) : none()};
  }
  c10::OptionalDeviceGuard guard(x.device());
  const int64_t N = rows.expect_int();
  const at::Tensor x2 = x.reshape({N, s.H});
  const int64_t I = s.I;
  // What is kept is allocated whole and filled block by block; the rest lives one block at a time.
  at::Tensor gate = keep_gate ? at::empty({N, whole ? 2 * I : I}, x.options()) : none();
  at::Tensor up = keep_up && !s.fused ? at::empty({N, I}, x.options()) : none();
  at::Tensor y = at::empty({N, s.O}, x.options());
  const int64_t R = rows_per_block(I);
  PlannedBlocks blocks(x, blocks_of(N, R));
  for (int64_t r0 = 0, b = 0; r0 < N || (N == 0 && r0 == 0); r0 += R, ++b) {
    if (blocks.skip(b)) continue;
    const int64_t m = std::min(R, N - r0);
    const at::Tensor xr = x2.narrow(0, r0, m);
    // The block's projections by one route whatever is kept, so that the output is bitwise the
    // same in every recompute mode and below autograd (the plain kernel computes it as "gate_up"):
    // fused, one GEMM against the [2 I, H] weight; else one per weight. Each writes straight
    // into the kept tensor's rows (contiguous) where there is one.
    at::Tensor gr, ur;
    if (s.fused) {
      at::Tensor gu = whole ? gate.narrow(0, r0, m) : at::empty({m, 2 * I}, x.options());
      linear_into(gu, xr, gate_weight, gate_bias);
      gr = gu.narrow(1, 0, I), ur = gu.narrow(1, I, I);
      if (keep_gate && !whole) gate.narrow(0, r0, m).copy_(gr);
    } else {
      gr = keep_gate ? gate.narrow(0, r0, m) : at::empty({m, I}, x.options());
      ur = keep_up ? up.narrow(0, r0, m) : at::empty({m, I}, x.options());
      linear_into(gr, xr, gate_weight, gate_bias);
      linear_into(ur, xr, *up_weight, up_bias);
    }
    at::Tensor h = at::empty({m, I}, x.options());
    if (m > 0 && !x.is_meta()) {
      GatedMlpForwardParams p;
      fill_gate_up(p, s, gr, ur, m);
      p.h = h.mutable_data_ptr();
      run_core(x, p, gated_mlp_forward_cpu, gated_mlp_forward_cuda, kOp);
    }
    at::Tensor yr = y.narrow(0, r0, m);  // written in place: its rows are contiguous
    linear_into(yr, h, down_weight, down_bias);
    blocks.done(b);
  }
  return {y.view_symint(with_last(x, s.O)), gate, up};
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Grads backward_kernel(const at::Tensor& grad, const at::Tensor& x, const std::optional<at::Tensor>& gate_kept,
                      const std::optional<at::Tensor>& up_kept, const at::Tensor& gate_weight,
                      const std::optional<at::Tensor>& up_weight, const at::Tensor& down_weight,
                      const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
                      std::array<bool, 3> bias_grad, c10::string_view activation, int64_t chunk,
                      std::array<bool, 4> output_mask) {
  const char* bop = "tempo::gated_mlp_backward";
  const Shape s = check(x, gate_weight, get(up_weight), down_weight, get(gate_bias), get(up_bias), nullptr, activation);
  TORCH_CHECK(chunk >= 0, bop, ": chunk must be >= 0 (0: automatic), got ", chunk);
  const bool fused = s.fused;
  bias_grad[1] = bias_grad[1] && !fused;  // a fused projection's one bias is gate_bias
  const auto [need_dx, need_dgate, need_dup_weight, need_ddown] = output_mask;
  const bool need_dup_w = need_dup_weight && !fused;  // a fused projection's up rows are gate_weight's
  auto maybe = [](bool need, auto&& make) { return need ? make() : at::Tensor(); };
  // the gradients' shapes (allocated here on every device; computed below off Meta)
  at::Tensor dgw = maybe(need_dgate, [&] { return at::empty_like(gate_weight); });
  at::Tensor duw = maybe(need_dup_w, [&] { return at::empty_like(*up_weight); });
  at::Tensor ddw = maybe(need_ddown, [&] { return at::empty_like(down_weight); });
  at::Tensor dgb = maybe(bias_grad[0], [&] { return at::zeros({fused ? 2 * s.I : s.I}, x.options()); });
  at::Tensor dub = maybe(bias_grad[1], [&] { return at::zeros({s.I}, x.options()); });
  at::Tensor ddb = maybe(bias_grad[2], [&] { return at::empty({s.O}, x.options()); });
  if (shapes_only(x) || shapes_only(grad)) {
    at::Tensor dx = maybe(need_dx, [&] { return at::empty_like(x, at::MemoryFormat::Contiguous); });
    return {dx, dgw, duw, ddw, dgb, dub, ddb};
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = s.O;
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(out_shape), bop, ": argument 'grad' must have the output's shape ",
              at::IntArrayRef(out_shape), ", got ", grad.sizes());
  check_like(grad, x, bop, "grad");
  const int64_t N = x.numel() / s.H;
  // What the forward kept: gate [N, I] and up [N, I]; fused, the whole projection [N, 2 I] or its
  // gate half [N, I]; absent (or empty) where the backward recomputes it from x.
  const at::Tensor gate = gate_kept.has_value() && gate_kept->numel() > 0 ? *gate_kept : at::Tensor();
  const at::Tensor up = up_kept.has_value() && up_kept->numel() > 0 ? *up_kept : at::Tensor();
  const bool whole = fused && gate.defined() && gate.dim() == 2 && gate.size(1) == 2 * s.I;
  TORCH_CHECK(!gate.defined() ||
                  (gate.dim() == 2 && gate.size(0) == N && (gate.size(1) == s.I || whole) && gate.stride(1) == 1),
              bop, ": argument 'gate' must be the forward's [", N, ", ", s.I, "]",
              fused ? " (or the fused projection's [rows, 2 I])" : "", " or absent, got ", gate.sizes());
  TORCH_CHECK(!(fused && up.defined()), bop, ": argument 'up' must be absent with a fused gate_up projection");
  TORCH_CHECK(!up.defined() || (up.dim() == 2 && up.size(0) == N && up.size(1) == s.I && up.stride(1) == 1), bop,
              ": argument 'up' must be the forward's [", N, ", ", s.I, "] or absent, got ", up.sizes());
  if (gate.defined()) check_like(gate, x, bop, "gate");
  if (up.defined()) check_like(up, x, bop, "up");
  c10::OptionalDeviceGuard guard(x.device());
  const bool low = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const at::Tensor dy = grad.reshape({N, s.O}).contiguous();
  const at::Tensor x2 = x.reshape({N, s.H});
  const at::Tensor g = whole ? gate.narrow(1, 0, s.I) : gate;
  const at::Tensor u = whole ? gate.narrow(1, s.I, s.I) : up;
  const at::Tensor& wu_all = fused ? gate_weight : *up_weight;
  const std::optional<at::Tensor>& ub_all = fused ? gate_bias : up_bias;
  const int64_t up_row0 = fused ? s.I : 0;  // a fused projection's up rows are I rows further
  // dx summed over the blocks in the math type (float32 for 16-bit data), rounded once
  at::Tensor dx_acc = maybe(need_dx, [&] {
    return at::zeros({N, s.H}, x.options().dtype(low ? at::kFloat : x.scalar_type()));
  });
  if (bias_grad[2]) ddb.copy_(dy.sum(0));
  const int64_t C = columns_per_block(chunk, s), R = rows_per_block(C);
  const at::TensorOptions math = x.options().dtype(low ? at::kFloat : x.scalar_type());
  PlannedBlocks columns(x, N > 0 ? blocks_of(s.I, C) : 0);
  for (int64_t c0 = 0, cb = 0; c0 < s.I && N > 0; c0 += C, ++cb) {
    if (columns.skip(cb)) continue;
    const int64_t n = std::min(C, s.I - c0);
    // rows [c0, c0 + n) of the gate and up weights (fused: up's are I rows further), columns of down's
    const at::Tensor wg = gate_weight.narrow(0, c0, n);
    const at::Tensor wu = wu_all.narrow(0, up_row0 + c0, n);
    const at::Tensor wd = down_weight.narrow(1, c0, n);
    // this column block's weight and bias gradients, summed over the row blocks in the math type
    at::Tensor acc_g = maybe(need_dgate, [&] { return at::zeros({n, s.H}, math); });
    at::Tensor acc_u = maybe(need_dup_w || (fused && need_dgate), [&] { return at::zeros({n, s.H}, math); });
    at::Tensor acc_d = maybe(need_ddown, [&] { return at::zeros({s.O, n}, math); });
    at::Tensor acc_gb = maybe(bias_grad[0], [&] { return at::zeros({n}, math); });
    at::Tensor acc_ub = maybe(bias_grad[1] || (fused && bias_grad[0]), [&] { return at::zeros({n}, math); });
    PlannedBlocks rows(x, blocks_of(N, R));
    for (int64_t r0 = 0, rb = 0; r0 < N; r0 += R, ++rb) {
      if (rows.skip(rb)) continue;
      const int64_t m = std::min(R, N - r0);
      const at::Tensor xr = x2.narrow(0, r0, m), dyr = dy.narrow(0, r0, m);
      const at::Tensor dh = at::mm(dyr, wd);  // [m, n]
      const at::Tensor g_block = block_of(g.defined() ? g.narrow(0, r0, m) : g, xr, gate_weight, gate_bias, 0, c0, n);
      const at::Tensor u_block = block_of(u.defined() ? u.narrow(0, r0, m) : u, xr, wu_all, ub_all, up_row0, c0, n);
      at::Tensor dg = at::empty({m, n}, x.options()), du = at::empty({m, n}, x.options());
      at::Tensor h = maybe(need_ddown, [&] { return at::empty({m, n}, x.options()); });
      if (!x.is_meta()) {
        GatedMlpBackwardParams p;
        fill_gate_up(p, s, g_block, u_block, m);
        p.grad_h = dh.const_data_ptr();
        p.grad_gate = dg.mutable_data_ptr();
        p.grad_up = du.mutable_data_ptr();
        p.grad_gate_stride = p.grad_up_stride = n;
        p.h = need_ddown ? h.mutable_data_ptr() : nullptr;
        run_core(x, p, gated_mlp_backward_cpu, gated_mlp_backward_cuda, bop);
      }
      if (acc_d.defined()) add_matmul(acc_d, dyr.t(), h, low);
      if (acc_g.defined()) add_matmul(acc_g, dg.t(), xr, low);
      if (acc_u.defined()) add_matmul(acc_u, du.t(), xr, low);
      if (acc_gb.defined()) acc_gb.add_(dg.sum(0, false, acc_gb.scalar_type()));
      if (acc_ub.defined()) acc_ub.add_(du.sum(0, false, acc_ub.scalar_type()));
      if (need_dx) {
        at::Tensor dxr = dx_acc.narrow(0, r0, m);
        add_matmul(dxr, dg, wg, low);
        add_matmul(dxr, du, wu, low);
      }
      rows.done(rb);
    }
    if (need_ddown) ddw.narrow(1, c0, n).copy_(acc_d);
    if (need_dgate) dgw.narrow(0, c0, n).copy_(acc_g);
    if (fused && need_dgate) dgw.narrow(0, s.I + c0, n).copy_(acc_u);
    if (need_dup_w) duw.narrow(0, c0, n).copy_(acc_u);
    if (bias_grad[0]) dgb.narrow(0, c0, n).copy_(acc_gb);
    if (bias_grad[0] && fused) dgb.narrow(0, s.I + c0, n).copy_(acc_ub);
    if (bias_grad[1]) dub.narrow(0, c0, n).copy_(acc_ub);
    columns.done(cb);
  }
  if (N == 0) {  // no rows: every weight gradient is 0
    for (at::Tensor* t : {&dgw, &duw, &ddw})
      if (t->defined()) t->zero_();
  }
  at::Tensor dx = maybe(need_dx, [&] { return dx_acc.to(x.scalar_type()).view(x.sizes()); });
  return {dx, dgw, duw, ddw, dgb, dub, ddb};
}

// Below autograd (no_grad, inference): the output only.
at::Tensor composite(const at::Tensor& x, const at::Tensor& gate_weight, const std::optional<at::Tensor>& up_weight,
                     const at::Tensor& down_weight, const std::optional<at::Tensor>& gate_bias,
                     const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias,
                     c10::string_view activation, int64_t chunk, c10::string_view recompute) {
  TORCH_CHECK(chunk >= 0, kOp, ": chunk must be >= 0 (0: automatic), got ", chunk);
  gated_mlp_recompute(recompute);  // checked on every path
  return std::get<0>(
      forward_kernel(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, "gate_up"));
}

}  // namespace

// ---- C++ API: through the dispatcher, so autograd and every backend apply ------------------

GatedMlpRecompute gated_mlp_recompute(c10::string_view recompute) {
  if (recompute == "product") return GatedMlpRecompute::kProduct;
  if (recompute == "up") return GatedMlpRecompute::kUp;
  if (recompute == "gate_up") return GatedMlpRecompute::kGateUp;
  TORCH_CHECK(false, kOp, ": argument 'recompute' must be 'product', 'up' or 'gate_up', got '", std::string(recompute),
              "'");
}

at::Tensor gated_mlp(const at::Tensor& x, const at::Tensor& gate_weight, const std::optional<at::Tensor>& up_weight,
                     const at::Tensor& down_weight, const std::optional<at::Tensor>& gate_bias,
                     const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias,
                     c10::string_view activation, int64_t chunk, c10::string_view recompute) {
  static const auto& op = op_for<&gated_mlp>("tempo::gated_mlp");
  return op.call(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, chunk, recompute);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_mlp_forward(
    const at::Tensor& x, const at::Tensor& gate_weight, const std::optional<at::Tensor>& up_weight,
    const at::Tensor& down_weight, const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
    const std::optional<at::Tensor>& down_bias, c10::string_view activation, c10::string_view recompute) {
  static const auto& op = op_for<&gated_mlp_forward>("tempo::gated_mlp_forward");
  return op.call(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, recompute);
}

Grads gated_mlp_backward(const at::Tensor& grad, const at::Tensor& x, const std::optional<at::Tensor>& gate,
                         const std::optional<at::Tensor>& up, const at::Tensor& gate_weight,
                         const std::optional<at::Tensor>& up_weight, const at::Tensor& down_weight,
                         const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
                         std::array<bool, 3> bias_grad, c10::string_view activation, int64_t chunk,
                         std::array<bool, 4> output_mask) {
  static const auto& op = op_for<&gated_mlp_backward>("tempo::gated_mlp_backward");
  return op.call(grad, x, gate, up, gate_weight, up_weight, down_weight, gate_bias, up_bias, bias_grad, activation,
                 chunk, output_mask);
}

}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("gated_mlp", tempo::composite);
  m.impl("gated_mlp_forward", tempo::forward_kernel);
  m.impl("gated_mlp_backward", tempo::backward_kernel);
}
