// The planner's count (tempo.plan): every storage the meta device allocates and frees while a
// trace is open, in order, with the tag the planner set (phase, layer) and the innermost
// operator running, so that a training step run on the meta device gives the sequence of
// allocations a real device would see, and from it the peak, where it falls and what a caching
// allocator would make of it. The meta device allocates nothing; a counting allocator is put in
// front of its allocator for this (c10::SetAllocator on kMeta), handing out DataPtrs whose
// context is the allocation's record, so that the free is seen when the storage goes.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tempo/memory.h"

namespace tempo::memory {
namespace {

struct Trace {
  std::mutex mutex;
  bool on = false;
  PlannedDevice device = PlannedDevice::kNone;
  bool cpu = false;                           // the counting CPU allocator's events too
  std::unordered_map<int64_t, double> flops;  // by tag: the matmul FLOPs the operators ran
  uint64_t session = 0;
  int64_t next_id = 0;
  // (allocation id, +bytes or -bytes, tag, operator, -1; or a sum's marker: id, 0, tag, operator, the operand)
  std::vector<std::array<int64_t, 5>> events;
  std::vector<std::string> tags{""}, ops{""};
  std::unordered_map<std::string, int64_t> tag_ids{{"", 0}}, op_ids{{"", 0}};
  int64_t tag = 0;
  uint64_t callback = 0;
  std::unordered_set<int64_t> live;  // allocations not yet freed
};
Trace& trace() {
  static Trace* t = new Trace();  // never destroyed: storages may be freed during static destruction
  return *t;
}

thread_local std::vector<int64_t> t_ops;  // the operators open on this thread, innermost last
std::atomic<bool> g_cpu{false};           // a trace with the CPU's events is open (checked before any lock)

// Gradient accumulation: autograd sums two gradients of one tensor (the engine's own add, outside
// any backward function) or a gradient into a parameter's existing one (AccumulateGrad). A device
// adds in place into an operand whose storage nothing else shares; for a tensor subclass, such as
// the plan's fake tensors, autograd always makes a new tensor. For such an add, t_sums holds the
// operand a device would have added into and the allocations the add makes; when it returns, the
// one still alive (the sum) is marked by an event of 0 bytes carrying that operand's id
// (allocator.py then counts the sum as the operand, updated in place).
struct Sum {
  int64_t target = -1;  // -1: not an accumulating add (or nothing to add into: a new tensor there too)
  std::vector<int64_t> made;
};
thread_local std::vector<Sum> t_sums;  // beside t_ops
const char* const kAccumulateGrad = "torch::autograd::AccumulateGrad";

struct Record {
  uint64_t session;
  int64_t id, bytes;
};

void free_record(void* ctx);

// The allocation id of t's storage, if the plan counted it and (sole) nothing else holds the
// storage: a fake tensor's storage carries a reference or two more than a device tensor's (at
// most two where the device's would hold one). Else -1.
int64_t counted_id(const c10::IValue& v, bool sole) {
  if (!v.isTensor()) return -1;
  const at::Tensor& t = v.toTensor();
  if (!t.has_storage() || !t.is_non_overlapping_and_dense()) return -1;
  const c10::Storage& s = t.storage();
  if ((sole && s.use_count() > 2) || s.data_ptr().get_deleter() != &free_record) return -1;
  return static_cast<const Record*>(s.data_ptr().get_context())->id;
}

// For an add that accumulates gradients, the operand a device adds into in place, else -1: the
// engine adds into the gradient it holds where nothing else shares its storage (InputBuffer's
// accumulate), AccumulateGrad into the parameter's existing gradient.
int64_t inplace_target(const std::string& name, const at::RecordFunction& fn, const std::vector<std::string>& ops) {
  if (name != "aten::add" || t_ops.empty()) return -1;
  const std::string& parent = ops[t_ops.back()];
  const bool engine = parent.rfind("autograd::engine::evaluate_function", 0) == 0;
  if (parent != kAccumulateGrad && !engine) return -1;
  const auto in = fn.inputs();
  return in.size() < 2 ? -1 : counted_id(in[0], engine);
}

int64_t intern(std::unordered_map<std::string, int64_t>& ids, std::vector<std::string>& names, const std::string& s) {
  auto it = ids.find(s);
  if (it != ids.end()) return it->second;
  names.push_back(s);
  return ids[s] = static_cast<int64_t>(names.size()) - 1;
}

void free_record(void* ctx) {
  auto* r = static_cast<Record*>(ctx);
  {
    Trace& t = trace();
    std::lock_guard<std::mutex> g(t.mutex);
    if (t.on && r->session == t.session) {
      t.events.push_back({r->id, -r->bytes, t.tag, t_ops.empty() ? 0 : t_ops.back(), -1});
      t.live.erase(r->id);
    }
  }
  delete r;
}

class MetaCounting final : public c10::Allocator {
 public:
  explicit MetaCounting(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    Trace& t = trace();
    std::lock_guard<std::mutex> g(t.mutex);
    if (!t.on || n == 0) return inner;
    auto* r = new Record{t.session, t.next_id++, static_cast<int64_t>(n)};
    t.events.push_back({r->id, r->bytes, t.tag, t_ops.empty() ? 0 : t_ops.back(), -1});
    t.live.insert(r->id);
    for (Sum& sum : t_sums)
      if (sum.target >= 0) sum.made.push_back(r->id);
    return {inner.get(), r, &free_record, inner.device()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {}  // the meta device holds no data

 private:
  c10::Allocator* base_;
};

std::vector<int64_t> shape_of(const c10::IValue& v) {
  if (!v.isTensor()) return {};
  const at::Tensor& t = v.toTensor();
  std::vector<int64_t> out;
  for (const c10::SymInt& s : t.sym_sizes()) out.push_back(s.maybe_as_int().value_or(0));
  return out;
}
double prod(const std::vector<int64_t>& s, size_t from, size_t to) {
  double p = 1;
  for (size_t i = from; i < to && i < s.size(); ++i) p *= static_cast<double>(s[i]);
  return p;
}

// Multiply-adds times 2 of the matrix products an operator runs, from its operands' shapes: the
// GEMMs (mm, addmm, bmm, baddbmm; linear and matmul are counted as those), and the fused
// attention kernels as two products each way (forward: q k^T and p v; backward: four, the
// recomputed scores included for flash and memory-efficient), as torch.utils.flop_counter
// counts them, except that a causal call counts only the (query, key) pairs its mask lets
// through, as the kernels skip the masked blocks: aligned bottom-right in CUDA's flash kernel
// (query i of Sq sees keys up to Sk - Sq + i), top-left in the others. 0 for everything else.
struct AttentionOp {
  const char* name;
  bool backward;
  size_t causal;  // the index of its is_causal argument
  bool bottom_right;
};
constexpr AttentionOp kAttentionOps[] = {
    {"aten::_scaled_dot_product_flash_attention", false, 4, true},
    {"aten::_scaled_dot_product_flash_attention_backward", true, 11, true},
    {"aten::_scaled_dot_product_efficient_attention", false, 6, false},
    {"aten::_scaled_dot_product_efficient_attention_backward", true, 11, false},
    {"aten::_scaled_dot_product_flash_attention_for_cpu", false, 4, false},
    {"aten::_scaled_dot_product_flash_attention_for_cpu_backward", true, 7, false},
    {"aten::_scaled_dot_product_cudnn_attention", false, 6, false},
    {"aten::_scaled_dot_product_cudnn_attention_backward", true, 14, false},
};

// The (query, key) pairs of one head an Sq x Sk attention computes.
double attention_pairs(double sq, double sk, bool causal, bool bottom_right) {
  if (!causal) return sq * sk;
  if (bottom_right && sq <= sk) return sq * (sk - sq) + sq * (sq + 1) / 2;
  const double rows = std::min(sq, sk);  // top-left: query i sees keys 0..i
  return rows * (rows + 1) / 2 + (sq - rows) * sk;
}

double flops_of(const std::string& name, c10::ArrayRef<const c10::IValue> in) {
  auto arg = [&](size_t i) { return i < in.size() ? shape_of(in[i]) : std::vector<int64_t>{}; };
  if (name == "aten::mm") {
    const auto a = arg(0), b = arg(1);
    return a.size() == 2 && b.size() == 2 ? 2.0 * a[0] * a[1] * b[1] : 0.0;
  }
  if (name == "aten::addmm") {
    const auto a = arg(1), b = arg(2);
    return a.size() == 2 && b.size() == 2 ? 2.0 * a[0] * a[1] * b[1] : 0.0;
  }
  if (name == "aten::bmm" || name == "aten::baddbmm") {
    const auto a = arg(name == "aten::bmm" ? 0 : 1), b = arg(name == "aten::bmm" ? 1 : 2);
    return a.size() == 3 && b.size() == 3 ? 2.0 * a[0] * a[1] * a[2] * b[2] : 0.0;
  }
  for (const AttentionOp& op : kAttentionOps) {
    if (name != op.name) continue;
    // q [B, H, Sq, D], k [B, Hk, Sk, D], v [B, Hk, Sk, Dv]
    const auto q = arg(op.backward ? 1 : 0), k = arg(op.backward ? 2 : 1), v = arg(op.backward ? 3 : 2);
    if (q.size() != 4 || k.size() != 4 || v.size() != 4) return 0.0;
    const bool causal = op.causal < in.size() && in[op.causal].isBool() && in[op.causal].toBool();
    const double pairs = attention_pairs(static_cast<double>(q[2]), static_cast<double>(k[2]), causal, op.bottom_right);
    const double scores = prod(q, 0, 2) * pairs;  // B H and the pairs
    const double one = 2.0 * scores * (static_cast<double>(q[3]) + static_cast<double>(v[3]));
    return op.backward ? 2.0 * one : one;
  }
  return 0.0;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  const double f = fn.scope() == at::RecordScope::FUNCTION ? flops_of(name, fn.inputs()) : 0.0;
  Trace& t = trace();
  std::lock_guard<std::mutex> g(t.mutex);
  const int64_t id = intern(t.op_ids, t.ops, name);
  // an operator called again inside its own call (a fake tensor's dispatch, then its kernel) counted once
  if (f > 0 && (t_ops.empty() || t_ops.back() != id)) t.flops[t.tag] += f;
  t_sums.push_back(Sum{inplace_target(name, fn, t.ops), {}});
  t_ops.push_back(id);
  return nullptr;
}
void on_end(const at::RecordFunction&, at::ObserverContext*) {
  if (t_ops.empty()) return;
  const int64_t op = t_ops.back();
  t_ops.pop_back();
  const Sum sum = std::move(t_sums.back());
  t_sums.pop_back();
  if (sum.target < 0) return;
  Trace& t = trace();
  std::lock_guard<std::mutex> g(t.mutex);
  for (int64_t id : sum.made)
    if (t.live.count(id)) t.events.push_back({id, 0, t.tag, op, sum.target});
}

void plan_start(c10::string_view device, bool cpu) {
  TORCH_CHECK(device == "cpu" || device == "cuda", "tempo::memory_plan_start: device must be 'cpu' or 'cuda', got '",
              std::string(device), "'");
  static std::once_flag installed;
  std::call_once(installed, [] {
    static MetaCounting allocator(c10::GetAllocator(c10::DeviceType::Meta));
    c10::SetAllocator(c10::DeviceType::Meta, &allocator, /*priority=*/100);
  });
  Trace& t = trace();
  {
    std::lock_guard<std::mutex> g(t.mutex);
    TORCH_CHECK(!t.on, "tempo::memory_plan_start: a trace is already open");
    t.on = true;
    ++t.session;
    t.next_id = 0;
    t.events.clear();
    t.live.clear();
    t.flops.clear();
    t.tag = 0;
    t.device = device == "cuda" ? PlannedDevice::kCuda : PlannedDevice::kCpu;
    t.cpu = cpu;
    g_cpu = cpu;
  }
  t_ops.clear();
  t_sums.clear();
  t.callback = at::addThreadLocalCallback(at::RecordFunctionCallback(on_start, on_end)
                                              .needsInputs(true)
                                              .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

void plan_tag(c10::string_view tag) {
  Trace& t = trace();
  std::lock_guard<std::mutex> g(t.mutex);
  t.tag = intern(t.tag_ids, t.tags, std::string(tag));
}

// (events [N, 5] int64: allocation id, bytes (negative: freed), tag index, operator index, -1; or
// a sum's marker (t_sums); the
// tags; the operators; the matmul FLOPs by tag index, a float64 vector as long as the tags)
std::tuple<at::Tensor, std::vector<std::string>, std::vector<std::string>, at::Tensor> plan_stop() {
  Trace& t = trace();
  at::removeCallback(t.callback);
  std::lock_guard<std::mutex> g(t.mutex);
  TORCH_CHECK(t.on, "tempo::memory_plan_stop: no trace is open");
  t.on = false;
  g_cpu = false;
  t.device = PlannedDevice::kNone;
  at::Tensor events = at::empty({static_cast<int64_t>(t.events.size()), 5}, at::kLong);
  if (!t.events.empty())
    std::memcpy(events.data_ptr<int64_t>(), t.events.data(), t.events.size() * 5 * sizeof(int64_t));
  t.events.clear();
  at::Tensor flops = at::zeros({static_cast<int64_t>(t.tags.size())}, at::kDouble);
  for (const auto& [tag, f] : t.flops) flops[tag] = f;
  return {events, t.tags, t.ops, flops};
}

}  // namespace

void plan_note_flops(double flops) {
  Trace& t = trace();
  std::lock_guard<std::mutex> g(t.mutex);
  if (t.on) t.flops[t.tag] += flops;
}

double plan_flops_now() {
  Trace& t = trace();
  std::lock_guard<std::mutex> g(t.mutex);
  auto it = t.flops.find(t.tag);
  return it == t.flops.end() ? 0.0 : it->second;
}

void plan_note_cpu(const void* data, int64_t bytes) {
  if (!g_cpu.load(std::memory_order_relaxed)) return;
  Trace& t = trace();
  std::lock_guard<std::mutex> g(t.mutex);
  if (t.on && t.cpu)
    t.events.push_back(
        {static_cast<int64_t>(reinterpret_cast<intptr_t>(data)), bytes, t.tag, t_ops.empty() ? 0 : t_ops.back(), -1});
}

PlannedDevice planned_device() {
  Trace& t = trace();
  std::lock_guard<std::mutex> g(t.mutex);
  return t.on ? t.device : PlannedDevice::kNone;
}

namespace {}  // namespace
}  // namespace tempo::memory

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def("memory_plan_start(str device, bool cpu=False) -> ()", &tempo::memory::plan_start);
  m.def("memory_plan_tag(str tag) -> ()", &tempo::memory::plan_tag);
  m.def("memory_plan_stop() -> (Tensor, str[], str[], Tensor)", &tempo::memory::plan_stop);
}
