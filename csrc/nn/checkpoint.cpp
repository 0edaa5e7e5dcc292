#include "tempo/nn/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <set>
#include <unordered_set>

namespace tempo::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(CheckpointFn f) : fn(std::move(f)) {}
  CheckpointFn fn;
};

// Generator states of the default CPU generator and of the CUDA devices of `inputs`.
struct RngStates {
  std::vector<c10::Device> devices;
  std::vector<at::Tensor> states;
  static RngStates capture(const std::vector<at::Tensor>& inputs) {
    std::set<c10::DeviceIndex> cuda;
    for (const auto& t : inputs)
      if (t.defined() && t.is_cuda()) cuda.insert(t.device().index());
    RngStates s;
    s.devices.push_back(c10::Device(c10::kCPU));
    for (auto i : cuda) s.devices.push_back(c10::Device(c10::kCUDA, i));
    for (const auto& d : s.devices) {
      auto gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.states.push_back(gen.get_state());
    }
    return s;
  }
  void restore() const {
    for (size_t i = 0; i < devices.size(); ++i) {
      auto gen = at::globalContext().defaultGenerator(devices[i]);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(states[i]);
    }
  }
};

// The leaves (parameters) that `out`'s graph reads other than through `inputs`: the
// AccumulateGrad nodes reachable from out's grad_fn without passing an input's node.
std::vector<at::Tensor> leaves_of(const at::Tensor& out, const std::vector<at::Tensor>& inputs) {
  std::unordered_set<const torch::autograd::Node*> stop, seen;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) stop.insert(torch::autograd::impl::gradient_edge(t).function.get());
  std::vector<at::Tensor> leaves;
  std::vector<torch::autograd::Node*> todo;
  if (out.grad_fn()) todo.push_back(out.grad_fn().get());
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    for (const auto& e : n->next_edges()) {
      torch::autograd::Node* next = e.function.get();
      if (!next || stop.count(next) || !seen.insert(next).second) continue;
      if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(next)) {
        if (acc->variable.defined()) leaves.push_back(acc->variable);
      } else {
        todo.push_back(next);
      }
    }
  }
  return leaves;
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<FnHolder> holder, at::TensorList inputs) {
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    const RngStates rng = RngStates::capture(in);
    at::Tensor out;
    {
      at::NoGradGuard no_grad;
      out = holder->fn(in);
    }
    ctx->save_for_backward(in);
    ctx->saved_data["fn"] = c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(holder));
    ctx->saved_data["rng"] = c10::List<at::Tensor>(rng.states);
    std::vector<int64_t> dev;
    for (const auto& d : rng.devices) dev.push_back(d.is_cuda() ? d.index() : -1);
    ctx->saved_data["rng_devices"] = dev;
    c10::List<bool> needs;
    for (const auto& t : in) needs.push_back(t.defined() && t.requires_grad());
    ctx->saved_data["needs_grad"] = needs;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    const auto needs = ctx->saved_data["needs_grad"].toBoolList();
    // Under create_graph=True the recomputation runs on the saved inputs themselves, whose
    // history leads to the forward's inputs, so the gradients it returns are functions of
    // them and differentiate again (through fn's own ops); otherwise on detached copies.
    const bool create_graph = at::GradMode::is_enabled();
    std::vector<at::Tensor> in;
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor t = saved[i];
      if (!create_graph && t.defined()) {
        t = t.detach();
        if (needs[i]) t.requires_grad_(true);
      }
      in.push_back(t);
    }
    RngStates replay;
    for (int64_t d : ctx->saved_data["rng_devices"].toIntVector())
      replay.devices.push_back(d < 0 ? c10::Device(c10::kCPU)
                                     : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d)));
    for (const auto& s : ctx->saved_data["rng"].toTensorList()) replay.states.push_back(s);
    const RngStates now = RngStates::capture(in);
    replay.restore();
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      out = holder->fn(in);
    }
    now.restore();
    variable_list result{at::Tensor()};  // for the function
    if (create_graph) {
      // One differentiable pass for the inputs and for the leaves fn reads (its parameters),
      // whose gradients are accumulated as a backward under create_graph would.
      std::vector<at::Tensor> wrt;
      for (size_t i = 0; i < in.size(); ++i)
        if (needs[i]) wrt.push_back(in[i]);
      const size_t n_inputs = wrt.size();
      const std::vector<at::Tensor> params = leaves_of(out, in);
      wrt.insert(wrt.end(), params.begin(), params.end());
      variable_list g;
      if (out.requires_grad() && !wrt.empty())
        g = torch::autograd::grad({out}, wrt, {grads[0]}, /*retain_graph=*/true, /*create_graph=*/true,
                                  /*allow_unused=*/true);
      size_t k = 0;
      for (size_t i = 0; i < in.size(); ++i) result.push_back(needs[i] && k < g.size() ? g[k++] : at::Tensor());
      for (size_t j = 0; j < params.size() && n_inputs + j < g.size(); ++j) {
        const at::Tensor& gp = g[n_inputs + j];
        if (!gp.defined()) continue;
        at::Tensor p = params[j];
        at::Tensor& acc = p.mutable_grad();
        acc = acc.defined() ? acc + gp : gp;
      }
      return result;
    }
    if (out.requires_grad()) torch::autograd::backward({out}, {grads[0]});
    for (size_t i = 0; i < in.size(); ++i) result.push_back(needs[i] ? in[i].grad() : at::Tensor());
    return result;
  }
};

}  // namespace

at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs) {
  for (size_t i = 0; i < inputs.size(); ++i)
    TORCH_CHECK(inputs[i].defined(), "tempo::nn::checkpoint: input ", i, " is undefined");
  return CheckpointFunction::apply(c10::make_intrusive<FnHolder>(fn), at::TensorList(inputs));
}

}  // namespace tempo::nn
