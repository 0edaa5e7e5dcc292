#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_set>

#include "tempo/memory.h"

namespace tempo::memory {

struct TrafficScope::State {
  std::mutex mutex;
  std::string phase;
  std::vector<OpTraffic> ops;
};

namespace {
std::mutex g_mutex;
std::shared_ptr<TrafficScope::State> g_state;  // the active scope's

// Distinct elements of t times its element size: a broadcast (stride 0) dimension counts once.
int64_t tensor_bytes(const at::Tensor& t) {
  if (!t.defined()) return 0;
  int64_t n = 1;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.stride(d) != 0 || t.size(d) == 0) n *= t.size(d);
  return n * static_cast<int64_t>(t.element_size());
}

// A storage's identity: its StorageImpl (a data pointer would do on a device, but the planner's
// fake tensors hold none).
const void* storage_of(const at::Tensor& t) { return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr; }

void for_each_tensor(const c10::IValue& v, const std::function<void(const at::Tensor&)>& f) {
  if (v.isTensor())
    f(v.toTensor());
  else if (v.isTensorList())
    for (const at::Tensor& t : v.toTensorVector()) f(t);
  else if (v.isList())
    for (const c10::IValue& e : v.toListRef()) for_each_tensor(e, f);
  else if (v.isTuple())
    for (const c10::IValue& e : v.toTupleRef().elements()) for_each_tensor(e, f);
}

// The operator calls open on this thread, innermost last. An operator is counted when none of
// the calls it made moved data (a kernel, whose only sub-calls allocate or make views);
// otherwise its sub-calls were counted instead (a composite such as linear or layer_norm, or
// autograd's evaluate_function around a backward).
struct Frame {
  int64_t read = 0;
  std::vector<const void*> storages;  // of the operands, to recognise views
  std::vector<int64_t> bytes;         // of each operand (as storages)
  bool children_moved = false;
  std::unordered_set<const void*> child_read, child_written;  // storages the counted sub-calls touched
};
// In-place operators that overwrite their first operand without reading it.
bool writes_only_self(const std::string& name) {
  static const std::unordered_set<std::string> names{"aten::fill_",    "aten::zero_",   "aten::copy_",
                                                     "aten::uniform_", "aten::normal_", "aten::bernoulli_",
                                                     "aten::random_",  "aten::resize_"};
  return names.count(name) > 0;
}
thread_local std::vector<Frame> t_frames;

void record(const std::string& name, int64_t read, int64_t written) {
  std::shared_ptr<TrafficScope::State> state;
  {
    std::lock_guard<std::mutex> g(g_mutex);
    state = g_state;
  }
  if (!state) return;
  std::lock_guard<std::mutex> g(state->mutex);
  for (auto& o : state->ops)
    if (o.op == name && o.phase == state->phase) {
      ++o.calls, o.read += read, o.written += written;
      return;
    }
  state->ops.push_back(OpTraffic{state->phase, name, 1, read, written});
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  Frame f;
  std::unordered_set<const void*> seen;
  for (const c10::IValue& v : fn.inputs())
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
      f.storages.push_back(storage_of(t));
      f.bytes.push_back(tensor_bytes(t));
    });
  if (writes_only_self(fn.name()) && !f.bytes.empty()) f.bytes[0] = 0;
  for (int64_t b : f.bytes) f.read += b;
  t_frames.push_back(std::move(f));
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (t_frames.empty()) return;
  Frame f = std::move(t_frames.back());
  t_frames.pop_back();
  const std::string name = fn.name();
  const bool in_place = !name.empty() && name.back() == '_';
  int64_t written = 0, residual_written = 0;
  bool any_output = false, all_alias = true;
  std::vector<const void*> outputs;
  for (const c10::IValue& v : fn.outputs())
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!t.defined()) return;
      any_output = true;
      const void* s = storage_of(t);
      const bool alias = s && std::find(f.storages.begin(), f.storages.end(), s) != f.storages.end();
      all_alias = all_alias && alias;
      if (alias && !in_place) return;
      written += tensor_bytes(t);
      outputs.push_back(s);
      if (!f.child_written.count(s)) residual_written += tensor_bytes(t);
    });
  Frame* parent = t_frames.empty() ? nullptr : &t_frames.back();
  // The caller now knows this call moved data, and which storages it (or its sub-calls) read
  // and wrote.
  auto mark_parent = [&] {
    if (!parent) return;
    parent->children_moved = true;
    for (const void* s : f.storages) parent->child_read.insert(s);
    for (const void* s : outputs) parent->child_written.insert(s);
    parent->child_read.insert(f.child_read.begin(), f.child_read.end());
    parent->child_written.insert(f.child_written.begin(), f.child_written.end());
  };
  int64_t read = f.read;
  if (f.children_moved) {
    // Counted in its sub-calls, except what they did not touch: the operands no sub-call read
    // and the results no sub-call wrote (a kernel that calls ATen for part of its work).
    read = 0;
    for (size_t i = 0; i < f.storages.size(); ++i)
      if (!f.child_read.count(f.storages[i]) && !f.child_written.count(f.storages[i])) read += f.bytes[i];
    written = residual_written;
    mark_parent();  // its operands and results are accounted for, by it or its sub-calls
    if (read == 0 && written == 0) return;
  } else {
    if (!any_output) return;             // a query (sizes, a choice of backend)
    if (all_alias && !in_place) return;  // a view: moves nothing
    if (name == "aten::set_") return;    // a tensor given another's storage: moves nothing
    // Allocation without initialisation writes nothing.
    static const std::unordered_set<std::string> uninitialised{
        "aten::empty",     "aten::empty_strided",     "aten::empty_like",
        "aten::new_empty", "aten::new_empty_strided", "aten::empty_permuted"};
    if (uninitialised.count(name)) return;
    if (read == 0 && written == 0) return;  // no element moved (an empty tensor, a no-op conversion)
    mark_parent();
  }
  record(name, read, written);
}
}  // namespace

void note_traffic(const char* kernel, int64_t read, int64_t written) {
  {
    std::lock_guard<std::mutex> g(g_mutex);
    if (!g_state) return;
  }
  // The calling operator moved data through this pass: its own operands and results are then
  // counted only where no pass touched them (as for its dispatched sub-calls).
  if (!t_frames.empty()) t_frames.back().children_moved = true;
  record(kernel, read, written);
}

TrafficScope::TrafficScope(std::string phase) : state_(std::make_shared<State>()) {
  state_->phase = std::move(phase);
  {
    std::lock_guard<std::mutex> g(g_mutex);
    TORCH_CHECK(!g_state, "tempo::memory::TrafficScope: one scope at a time");
    g_state = state_;
  }
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(on_start, on_end)
                                           .needsInputs(true)
                                           .needsOutputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
}

TrafficScope::~TrafficScope() {
  at::removeCallback(handle_);
  std::lock_guard<std::mutex> g(g_mutex);
  g_state.reset();
}

void TrafficScope::set_phase(std::string phase) {
  std::lock_guard<std::mutex> g(state_->mutex);
  state_->phase = std::move(phase);
}

std::vector<OpTraffic> TrafficScope::ops() const {
  std::lock_guard<std::mutex> g(state_->mutex);
  return state_->ops;
}

int64_t TrafficScope::total() const {
  int64_t sum = 0;
  for (const auto& o : ops()) sum += o.read + o.written;
  return sum;
}

namespace {
// A scope opened from Python (tempo.plan counts a planned step's traffic through it).
std::unique_ptr<TrafficScope> g_python_scope;

void traffic_start(c10::string_view phase) {
  TORCH_CHECK(!g_python_scope, "tempo::memory_traffic_start: a traffic count is already open");
  g_python_scope = std::make_unique<TrafficScope>(std::string(phase));
}

void traffic_phase(c10::string_view phase) {
  TORCH_CHECK(g_python_scope, "tempo::memory_traffic_phase: no traffic count is open");
  g_python_scope->set_phase(std::string(phase));
}

// (phases, operators, calls, bytes read, bytes written), one entry per (phase, op): plain lists,
// not a tensor (a tensor made here under the planner's fake-tensor mode would be a fake one)
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>,
           std::vector<int64_t>>
traffic_stop() {
  TORCH_CHECK(g_python_scope, "tempo::memory_traffic_stop: no traffic count is open");
  const std::vector<OpTraffic> ops = g_python_scope->ops();
  g_python_scope.reset();
  std::vector<std::string> phases, names;
  std::vector<int64_t> calls, read, written;
  for (const OpTraffic& o : ops) {
    phases.push_back(o.phase), names.push_back(o.op);
    calls.push_back(o.calls), read.push_back(o.read), written.push_back(o.written);
  }
  return {phases, names, calls, read, written};
}
}  // namespace

}  // namespace tempo::memory

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def("memory_traffic_start(str phase) -> ()", &tempo::memory::traffic_start);
  m.def("memory_traffic_phase(str phase) -> ()", &tempo::memory::traffic_phase);
  m.def("memory_traffic_stop() -> (str[], str[], int[], int[], int[])", &tempo::memory::traffic_stop);
}
