// Schemas, kernels and C++ API of tempo::fused_attention: attention over blocks of query rows
// that keeps no S^2 tensor (the backward recomputes each block's probabilities). Matmuls
// through ATen, each block's softmax and dropout through the core's attention softmax.
#include "tempo/ops/fused_attention.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "attention.h"
#include "common.h"
#include "dtype.h"
#include "tempo/attention.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def(
      "fused_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float dropout_p=0.0, "
      "bool causal=False, float? scale=None, int block_rows=0) -> Tensor",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "fused_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool causal, "
      "float? scale, int block_rows) -> (Tensor, Tensor)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "fused_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor keep, Tensor? attn_mask, "
      "float dropout_p, bool causal, float? scale, int block_rows) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_attention_backend(Tensor q, Tensor k, Tensor? attn_mask=None, float dropout_p=0.0, "
      "bool causal=False, int block_rows=0) -> str");
}

namespace tempo {
namespace {
using namespace torch_impl;

int64_t block_rows_for(const at::Tensor& q, const at::Tensor& k, int64_t requested) {
  const int64_t Sq = q.size(2);
  if (requested > 0) return std::min(requested, std::max<int64_t>(Sq, 1));
  const int64_t per_row = std::max<int64_t>(q.size(0) * q.size(1) * k.size(2) * q.element_size(), 1);
  return std::max<int64_t>(1, std::min<int64_t>(Sq, (int64_t{8} << 20) / per_row));
}

std::tuple<at::Tensor, at::Tensor> fused_attention_forward_kernel(const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v,
                                                                  const std::optional<at::Tensor>& attn_mask,
                                                                  double dropout_p, bool causal,
                                                                  std::optional<double> scale, int64_t block_rows) {
  const char* op = "tempo::fused_attention";
  check_qkv(q, k, v, op);
  check_probability(dropout_p, op, "dropout_p");
  TORCH_CHECK(block_rows >= 0, op, ": argument 'block_rows' must be non-negative, got ", block_rows);
  const double sc = scale_of(q, scale);
  c10::OptionalDeviceGuard guard(q.device());
  const std::vector<c10::SymInt> full{q.sym_size(0), q.sym_size(1), q.sym_size(2), k.sym_size(2)};
  at::Tensor mask;
  if (attn_mask.has_value() && attn_mask->defined()) mask = additive_mask(*attn_mask, full, q.device(), op);
  DropoutKeep keep = new_dropout_keep(q, dropout_p, DropoutMode::kPhilox);
  at::Tensor out = at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2), v.sym_size(3)}, q.options());
  if (shapes_only(q)) return {out, keep.keep};
  const int64_t Sq = q.size(2), blk = block_rows_for(q, k, block_rows);
  // Contiguous once (q, k, v may be views of one projection): each block's matmuls would
  // otherwise copy them again.
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor kt = kc.transpose(-2, -1);
  PlannedBlocks blocks(q, blocks_of(Sq, blk));
  for (int64_t i0 = 0, b = 0; i0 < Sq; i0 += blk, ++b) {
    if (blocks.skip(b)) continue;
    const int64_t n = std::min(blk, Sq - i0);
    const at::Tensor qb = qc.narrow(2, i0, n);
    at::Tensor s = at::matmul(qb, kt).contiguous();
    at::Tensor d = dropout_p > 0.0 ? at::empty_like(s) : at::Tensor();
    softmax_forward(s, d, mask, q, i0, sc, causal, dropout_p, DropoutMode::kPhilox, nullptr, keep.rng, op);
    out.narrow(2, i0, n).copy_(at::matmul(d.defined() ? d : s, vc));
    blocks.done(b);
  }
  return {out, keep.keep};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_attention_backward_kernel(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal, std::optional<double> scale,
    int64_t block_rows) {
  const char* op = "tempo::fused_attention_backward";
  check_qkv(q, k, v, op);
  check_probability(dropout_p, op, "dropout_p");
  check_like(grad, q, op, "grad");
  TORCH_CHECK(grad.dim() == 4 && grad.sym_size(2) == q.sym_size(2) && grad.sym_size(3) == v.sym_size(3), op,
              ": argument 'grad' must have the shape of the output, got ", grad.sym_sizes());
  const double sc = scale_of(q, scale);
  PhiloxState rng;
  const uint8_t* unused = nullptr;
  read_dropout_keep(state, q, dropout_p, DropoutMode::kPhilox, op, &unused, &rng);
  c10::OptionalDeviceGuard guard(q.device());
  at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous), dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  if (shapes_only(q)) return {dq, dk, dv};
  if (q.size(2) == 0) {  // no query rows: no block writes dk, dv
    dk.zero_(), dv.zero_();
    return {dq, dk, dv};
  }
  at::Tensor mask;
  if (attn_mask.has_value() && attn_mask->defined()) {
    const std::vector<c10::SymInt> full{q.sym_size(0), q.sym_size(1), q.sym_size(2), k.sym_size(2)};
    mask = additive_mask(*attn_mask, full, q.device(), op);
  }
  const int64_t Sq = q.size(2), blk = block_rows_for(q, k, block_rows);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = grad.contiguous();
  const at::Tensor kt = kc.transpose(-2, -1), vt = vc.transpose(-2, -1);
  // dk and dv as [B A, Sk, d]: the first block writes them, the next add into them in place
  // (baddbmm_), so no block's product is a temporary added afterwards. 16-bit data over several
  // blocks sums in float32 and rounds once at the end (in its own dtype each block's addition
  // would round: about sqrt(blocks) rounding units of error).
  const int64_t BA = q.size(0) * q.size(1);
  const bool widen = (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) && blk < Sq;
  const auto acc_opts = k.options().dtype(at::kFloat);
  at::Tensor dk3 = widen ? at::empty({BA, k.size(2), k.size(3)}, acc_opts) : dk.view({BA, k.size(2), k.size(3)});
  at::Tensor dv3 = widen ? at::empty({BA, v.size(2), v.size(3)}, acc_opts) : dv.view({BA, v.size(2), v.size(3)});
  auto accumulate = [&](at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
    at::Tensor a3 = a.reshape({BA, a.size(2), a.size(3)}), b3 = b.reshape({BA, b.size(2), b.size(3)});
    if (widen) a3 = a3.to(at::kFloat), b3 = b3.to(at::kFloat);
    bmm_into(acc, a3, b3, !first);
  };
  PlannedBlocks blocks(q, blocks_of(Sq, blk));
  for (int64_t i0 = 0, b = 0; i0 < Sq; i0 += blk, ++b) {
    if (blocks.skip(b)) continue;
    const int64_t n = std::min(blk, Sq - i0);
    const at::Tensor qb = qc.narrow(2, i0, n), gb = gc.narrow(2, i0, n);
    // Recompute the block's P and P_d exactly as the forward did.
    at::Tensor s = at::matmul(qb, kt).contiguous();
    at::Tensor d = dropout_p > 0.0 ? at::empty_like(s) : at::Tensor();
    softmax_forward(s, d, mask, q, i0, sc, causal, dropout_p, DropoutMode::kPhilox, nullptr, rng, op);
    accumulate(dv3, (d.defined() ? d : s).transpose(-2, -1), gb, i0 == 0);
    d.reset();
    at::Tensor ds = at::matmul(gb, vt).contiguous();
    if (ds.numel() > 0 && !q.is_meta()) {
      AttentionSoftmaxBackwardParams params;
      params.dtype = to_core_dtype(q.scalar_type());
      params.grad = ds.mutable_data_ptr();
      params.probs = s.const_data_ptr();
      params.mode = DropoutMode::kPhilox;
      params.batch = ds.size(0);
      params.heads = ds.size(1);
      params.cols = ds.size(3);
      params.rows = n;
      params.row_offset = i0;
      params.seq_q = Sq;
      params.scale = sc;
      params.p = dropout_p;
      params.rng = rng;
      run_core(q, params, attention_softmax_backward_cpu, attention_softmax_backward_cuda, op);
      note_softmax_backward_traffic(ds);
    }
    dq.narrow(2, i0, n).copy_(at::matmul(ds, kc));
    accumulate(dk3, ds.transpose(-2, -1), qb, i0 == 0);
    blocks.done(b);
  }
  if (widen) {
    dk.view({BA, k.size(2), k.size(3)}).copy_(dk3);
    dv.view({BA, v.size(2), v.size(3)}).copy_(dv3);
  }
  return {dq, dk, dv};
}

at::Tensor fused_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                                  std::optional<double> scale, int64_t block_rows) {
  // the autograd kernel's choice (torch's sdpa where the semantics match), so the output is the
  // same with and without a graph
  if (fused_attention_uses_sdpa(q, k, attn_mask, dropout_p, causal, block_rows))
    return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal, scale);
  return std::get<0>(fused_attention_forward_kernel(q, k, v, attn_mask, dropout_p, causal, scale, block_rows));
}

}  // namespace

at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                           std::optional<double> scale, int64_t block_rows) {
  static const auto& op = op_for<&fused_attention>("tempo::fused_attention");
  return op.call(q, k, v, attn_mask, dropout_p, causal, scale, block_rows);
}

std::tuple<at::Tensor, at::Tensor> fused_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v,
                                                           const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                           bool causal, std::optional<double> scale,
                                                           int64_t block_rows) {
  static const auto& op = op_for<&fused_attention_forward>("tempo::fused_attention_forward");
  return op.call(q, k, v, attn_mask, dropout_p, causal, scale, block_rows);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal, std::optional<double> scale,
    int64_t block_rows) {
  static const auto& op = op_for<&fused_attention_backward>("tempo::fused_attention_backward");
  return op.call(grad, q, k, v, state, attn_mask, dropout_p, causal, scale, block_rows);
}

bool fused_attention_uses_sdpa(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& attn_mask,
                               double dropout_p, bool causal, int64_t block_rows) {
  static const bool forced_ours = [] {
    const char* e = std::getenv("TEMPO_FUSED_ATTENTION");
    return e && std::string(e) == "tempo";
  }();
  if (forced_ours || !q.is_cuda() || attn_mask.has_value() || dropout_p != 0.0 || block_rows != 0) return false;
  if (q.scalar_type() == at::kDouble || q.dim() != 4 || k.dim() != 4) return false;
  // torch's is_causal aligns the mask top-left; tempo's agrees only for square scores
  return !causal || q.size(2) == k.size(2);
}

namespace {
std::string fused_attention_backend_kernel(const at::Tensor& q, const at::Tensor& k,
                                           const std::optional<at::Tensor>& attn_mask, double dropout_p, bool causal,
                                           int64_t block_rows) {
  const char* op = "tempo::fused_attention_backend";
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&q, "q"}, {&k, "k"}}) {
    TORCH_CHECK(at::isFloatingType(t->scalar_type()), op, ": argument '", name, "' must be a floating tensor, got ",
                t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), op, ": argument '", name, "' must be on the device of q (", q.device(),
                "), got ", t->device());
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": argument 'k' must have the dtype of q (", q.scalar_type(),
              "), got ", k.scalar_type());
  if (attn_mask.has_value()) {
    TORCH_CHECK(attn_mask->scalar_type() == at::kBool || at::isFloatingType(attn_mask->scalar_type()), op,
                ": argument 'attn_mask' must be a bool or floating tensor, got ", attn_mask->scalar_type());
    TORCH_CHECK(attn_mask->device() == q.device(), op, ": argument 'attn_mask' must be on the device of q (",
                q.device(), "), got ", attn_mask->device());
  }
  return fused_attention_uses_sdpa(q, k, attn_mask, dropout_p, causal, block_rows) ? "torch-sdpa" : "tempo";
}
}  // namespace

}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("fused_attention_backend", tempo::fused_attention_backend_kernel);
  m.impl("fused_attention", tempo::fused_attention_kernel);
  m.impl("fused_attention_forward", tempo::fused_attention_forward_kernel);
  m.impl("fused_attention_backward", tempo::fused_attention_backward_kernel);
}
