// The columns a norm keeps xhat of (tempo::norm_kept_columns, tempo::norm_kept_slots) and their
// checks for the norm kernels (norm.cpp): one home for the rule's torch side; the rule itself is
// the core's norm_column_recoverable (csrc/core/norm.cpp), applied here on the host or by device ops.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include <deque>
#include <mutex>

#include "common.h"
#include "tempo/memory.h"
#include "dtype.h"
#include "norm_kept_columns.h"
#include "tempo/norm.h"
#include "tempo/ops/norm.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def("norm_kept_columns(Tensor? weight, Tensor? bias, ScalarType? dtype=None) -> Tensor");
  m.def("norm_kept_slots(Tensor? weight, Tensor? bias, ScalarType? dtype=None) -> Tensor");
}

namespace tempo {
namespace {
using namespace torch_impl;

// ---- the kept columns on the device (no host synchronisation) ---------------------------
//
// On CUDA the rule is evaluated by device ops into a fixed number of slots,
// norm_kept_capacity(cols), padded with -1: the size depends on the width alone, so nothing
// is read back and CUDA-graph capture and torch.compile see a static shape. The slots hold
// every kept column whenever at most that many need keeping (a real BERT's norms keep 0 to 6
// of 384 columns; the capacity there is 16). Beyond it the rest are recovered from y, inexact
// for those columns: the count of columns that needed keeping is copied to pinned host memory
// without waiting, and a later call that finds the copy done warns once, naming the count.

int64_t norm_kept_capacity(int64_t cols) { return std::min<int64_t>(cols, std::max<int64_t>(16, cols / 64)); }

namespace {
struct PendingCount {
  at::Tensor host;  // pinned: the number of columns that needed keeping
  c10::Event done;
  int64_t capacity, cols;
};
std::mutex pending_mutex;
std::deque<PendingCount> pending;

// Warns for every finished count that overflowed its capacity; drops finished entries.
void check_pending_counts() {
  std::lock_guard<std::mutex> lock(pending_mutex);
  while (!pending.empty() && pending.front().done.query()) {
    const PendingCount& c = pending.front();
    const int64_t need = c.host.const_data_ptr<int64_t>()[0];
    if (need > c.capacity)
      TORCH_WARN("tempo::norm_kept_columns: ", need, " of ", c.cols, " columns needed their xhat kept (gamma zero, ",
                 "subnormal or tiny against beta) where a CUDA norm keeps at most ", c.capacity, ": the rest were ",
                 "recovered from y in that step's backward, inexact for those columns");
    pending.pop_front();
  }
}

at::Tensor device_double(const at::Tensor* t, double absent, const at::Tensor& like, int64_t cols) {
  return t ? t->reshape({-1}).to(at::kDouble) : at::full({cols}, absent, like.options().dtype(at::kDouble));
}

at::Tensor kept_columns_on_device(const at::Tensor* w, const at::Tensor* b, const at::Tensor& ref,
                                  at::ScalarType data) {
  const int64_t cols = ref.numel(), capacity = norm_kept_capacity(cols);
  const DType dt = to_core_dtype(data);
  const at::Tensor g = device_double(w, 1.0, ref, cols), bb = device_double(b, 0.0, ref, cols);
  const at::Tensor ga = g.abs();
  // norm_column_recoverable, in double as on the host
  const at::Tensor ok = g.isfinite()
                            .logical_and(bb.isfinite())
                            .logical_and(ga.ge(norm_gamma_min(dt)))
                            .logical_and(bb.abs().le(ga * norm_recovery_ratio(dt)));
  const at::Tensor need = ok.logical_not();
  at::Tensor idx = at::nonzero_static(need, capacity, -1).reshape({-1});
  if (!ref.is_cpu() && !capturing(ref)) {
    check_pending_counts();
    PendingCount c{at::empty({1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true)),
                   c10::Event(ref.device().type()), capacity, cols};
    c.host.copy_(need.sum().reshape({1}), /*non_blocking=*/true);
    c.done.record(c10::impl::VirtualGuardImpl(ref.device().type()).getStream(ref.device()));
    std::lock_guard<std::mutex> lock(pending_mutex);
    pending.push_back(std::move(c));
  }
  return idx;
}
}  // namespace

// Checks norm_kept_columns's / norm_kept_slots's arguments; returns the data's dtype.
at::ScalarType check_kept_args(const at::Tensor* w, const at::Tensor* b, std::optional<at::ScalarType> dtype,
                               const char* op) {
  TORCH_CHECK(w || b, op, ": needs a weight or a bias (without both every column is recovered)");
  const at::Tensor& ref = w ? *w : *b;
  check_floating(ref, op, w ? "weight" : "bias");
  const at::ScalarType data = dtype.value_or(ref.scalar_type());
  TORCH_CHECK(data == ref.scalar_type() || (ref.scalar_type() == at::kFloat && low_precision(data)), op,
              ": argument 'dtype' (the data's) must be the parameters' dtype (", ref.scalar_type(), ")",
              ref.scalar_type() == at::kFloat ? ", bfloat16 or float16" : "", ", got ", data);
  if (w && b) {
    check_like(*b, *w, op, "bias");
    TORCH_CHECK(b->device() == w->device(), op, ": argument 'bias' must be on the device of weight (", w->device(),
                "), got ", b->device());
    TORCH_CHECK(b->sizes() == w->sizes(), op, ": argument 'bias' must have the shape of weight ", w->sizes(), ", got ",
                b->sizes());
  }
  TORCH_CHECK(!ref.is_meta(), op, ": the kept columns depend on the parameters' values; on meta/fake tensors ",
              "use the Python fake kernel (import tempo)");
  return data;
}

// The kept columns in norm_kept_capacity(cols) slots, padded with -1, by device ops on every
// device: what norm_kept_columns gives on CUDA (exposed so that the CPU tests run it too).
at::Tensor kept_slots_kernel(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             std::optional<at::ScalarType> dtype) {
  const at::Tensor* w = get(weight);
  const at::Tensor* b = get(bias);
  const at::ScalarType data = check_kept_args(w, b, dtype, "tempo::norm_kept_slots");
  return kept_columns_on_device(w, b, w ? *w : *b, data);
}

// The columns whose xhat the forward keeps (norm_column_recoverable decides), as int64 on the
// parameters' device: on the host, exactly those, ascending; on CUDA, in
// norm_kept_capacity(cols) slots padded with -1 (above).
at::Tensor kept_columns_kernel(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               std::optional<at::ScalarType> dtype) {
  const at::Tensor* w = get(weight);
  const at::Tensor* b = get(bias);
  const at::ScalarType data = check_kept_args(w, b, dtype, "tempo::norm_kept_columns");
  const at::Tensor& ref = w ? *w : *b;
  const int64_t cols = ref.numel();
  if (!ref.is_cpu()) return kept_columns_on_device(w, b, ref, data);
  const at::Tensor wc = w ? w->contiguous().cpu() : at::Tensor();
  const at::Tensor bc = b ? b->contiguous().cpu() : at::Tensor();
  at::Tensor idx = at::empty({cols}, at::TensorOptions().dtype(at::kLong));
  const int64_t k =
      norm_kept_columns(to_core_dtype(data), to_core_dtype(ref.scalar_type()), w ? wc.const_data_ptr() : nullptr,
                        b ? bc.const_data_ptr() : nullptr, cols, idx.mutable_data_ptr<int64_t>());
  return idx.narrow(0, 0, k).clone().to(ref.device());
}

}  // namespace

namespace torch_impl {

at::Tensor kept_slot(const at::Tensor* kept_cols, int64_t cols, const at::Tensor& like, const char* op) {
  if (!kept_cols) return at::Tensor();
  TORCH_CHECK(kept_cols->scalar_type() == at::kLong && kept_cols->dim() == 1, op,
              ": argument 'kept_cols' must be a 1-D int64 tensor, got ", kept_cols->scalar_type(), " of shape ",
              kept_cols->sym_sizes());
  TORCH_CHECK(kept_cols->device() == like.device(), op, ": argument 'kept_cols' must be on ", like.device());
  if (like.is_meta() || kept_cols->numel() == 0) return at::Tensor();  // meta: the size may be symbolic
  TORCH_CHECK(kept_cols->numel() <= cols, op, ": argument 'kept_cols' has more entries than the ", cols, " columns");
  if (kept_cols->is_cpu()) {  // on CUDA the values come from norm_kept_columns
    const at::Tensor kc = kept_cols->contiguous();
    const int64_t* c = kc.const_data_ptr<int64_t>();
    int64_t n = kc.numel();
    while (n > 0 && c[n - 1] == -1) --n;  // unused slots (norm_kept_slots) at the end
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(c[i] >= 0 && c[i] < cols && (i == 0 || c[i] > c[i - 1]), op,
                  ": argument 'kept_cols' must hold ascending column indices in [0, ", cols,
                  "), then only -1 (unused slots)");
  }
  if (like.is_meta()) return at::Tensor();
  // Entries of -1 (the device's unused slots) land in an extra last element, dropped.
  at::Tensor slot = at::full({cols + 1}, -1, like.options().dtype(at::kInt));
  const at::Tensor target = at::where(kept_cols->lt(0), at::full({}, cols, kept_cols->options()), *kept_cols);
  slot.index_put_({target}, at::arange(kept_cols->numel(), slot.options()));
  return slot.narrow(0, 0, cols);
}

void check_kept_xhat(const at::Tensor* kept_cols, const at::Tensor* kept_xhat, const c10::SymInt& rows,
                     const at::Tensor& y, const char* op) {
  if (!kept_cols) return;
  TORCH_CHECK(kept_xhat, op, ": argument 'kept_xhat' is needed with kept_cols");
  TORCH_CHECK(kept_xhat->scalar_type() == acc_type(y) && kept_xhat->device() == y.device() && kept_xhat->dim() == 2, op,
              ": argument 'kept_xhat' must be a 2-D ", acc_type(y), " tensor on ", y.device(), ", got ",
              kept_xhat->scalar_type(), " of shape ", kept_xhat->sym_sizes());
  if (y.is_meta()) return;  // sizes may be symbolic
  TORCH_CHECK(kept_xhat->size(0) == rows.expect_int() && kept_xhat->size(1) == kept_cols->numel(), op,
              ": argument 'kept_xhat' must have shape [", rows, ", ", kept_cols->numel(), "], got ",
              kept_xhat->sizes());
}

// The bias-dropout-residual prologue of a forward (bias_dropout_add_layer_norm).

}  // namespace torch_impl

// ---- C++ API ------------------------------------------------------------------------------

at::Tensor norm_kept_columns(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             std::optional<at::ScalarType> dtype) {
  // (the core's norm_kept_columns overloads the name: the signature is spelled out)
  static const auto op = op_handle<at::Tensor(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                              std::optional<at::ScalarType>)>("tempo::norm_kept_columns");
  return op.call(weight, bias, dtype);
}

at::Tensor norm_kept_slots(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           std::optional<at::ScalarType> dtype) {
  static const auto op = op_for<&norm_kept_slots>("tempo::norm_kept_slots");
  return op.call(weight, bias, dtype);
}

std::optional<at::Tensor> norm_kept_columns_for(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                const std::optional<at::Tensor>& beta, bool backward) {
  const bool w = weight.has_value() && weight->defined(), b = beta.has_value() && beta->defined();
  if (!w && !b) return std::nullopt;
  const at::ScalarType pt = (w ? *weight : *beta).scalar_type();
  if (pt != x.scalar_type() && !(pt == at::kFloat && torch_impl::low_precision(x.scalar_type()))) return std::nullopt;
  for (const auto* p : {w ? &*weight : nullptr, b ? &*beta : nullptr})
    if (p && (p->device() != x.device() || p->scalar_type() != pt)) return std::nullopt;
  if (!backward) return std::nullopt;
  const std::optional<at::Tensor> wo = w ? weight : std::nullopt, bo = b ? beta : std::nullopt;
  const bool traced =
      x.is_meta() ||
      x.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
  if (traced && memory::planned_device() == memory::PlannedDevice::kCpu) {
    // tempo.plan for the CPU, where norm_kept_columns decides on the host: what it makes there
    // for parameters whose every column recovers, as initialised ones do (the plan has no
    // values): a scratch of one int64 a column, and no column kept
    (void)at::empty({(w ? *weight : *beta).numel()}, x.options().dtype(at::kLong));
    return at::empty({0}, x.options().dtype(at::kLong));
  }
  return traced ? norm_kept_slots(wo, bo, x.scalar_type()) : norm_kept_columns(wo, bo, x.scalar_type());
}

}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("norm_kept_columns", tempo::kept_columns_kernel);
  m.impl("norm_kept_slots", tempo::kept_slots_kernel);
}
