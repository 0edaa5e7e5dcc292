#include "common.h"

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <utility>

namespace tempo::autograd_impl {
namespace {

using torch::autograd::edge_list;
using torch::autograd::variable_list;

// The refusal: raises whenever the engine runs it, that is whenever a gradient flows into
// one of the gradients it stands behind (its own inputs are never computed).
struct RefusedDoubleBackward : torch::autograd::Node {
  RefusedDoubleBackward(std::string op, edge_list&& next) : Node(std::move(next)), op_(std::move(op)) {}
  variable_list apply(variable_list&& /*grads*/) override {
    TORCH_CHECK(false, op_,
                ": double backward (differentiating a gradient computed with create_graph=True) is not supported: "
                "its backward keeps the output, not the input. Use the torch op for second derivatives "
                "(tempo.restore(model) undoes tempo.optimize).");
  }
  std::string name() const override { return op_ + "DoubleBackwardRefused"; }

 private:
  std::string op_;
};

// torch holds nodes by std::shared_ptr up to 2.11 and by c10::intrusive_ptr in 2.13: build
// one the way Edge holds it.
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename P>
struct MakeNode;
template <typename T>
struct MakeNode<std::shared_ptr<T>> {
  template <typename N, typename... A>
  static std::shared_ptr<T> make(A&&... a) {
    return std::make_shared<N>(std::forward<A>(a)...);
  }
};
template <typename T>
struct MakeNode<c10::intrusive_ptr<T>> {
  template <typename N, typename... A>
  static c10::intrusive_ptr<T> make(A&&... a) {
    return c10::make_intrusive<N>(std::forward<A>(a)...);
  }
};

}  // namespace

void refuse_double_backward(const char* op, const variable_list& grads_in, variable_list& grads) {
  bool any = false;
  for (const auto& g : grads) any = any || g.defined();
  if (!any) return;
  // The forward inputs' edges: those of the node the engine is running now, this op's own.
  edge_list next;
  if (auto node = torch::autograd::get_current_node()) next = node->next_edges();
  // The incoming gradients' edges, where they are functions of something (create_graph).
  for (const auto& g : grads_in)
    if (g.defined() && g.requires_grad()) next.push_back(torch::autograd::impl::gradient_edge(g));
  NodePtr refusal = MakeNode<NodePtr>::make<RefusedDoubleBackward>(std::string(op), std::move(next));
  for (auto& g : grads) {
    if (!g.defined()) continue;
    at::Tensor alias = g.detach();
    torch::autograd::create_gradient_edge(alias, refusal);
    g = std::move(alias);
  }
}

}  // namespace tempo::autograd_impl
