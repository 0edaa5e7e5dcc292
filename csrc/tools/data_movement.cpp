// `tempo bench --data-movement`: the bytes every operator of one transformer layer reads and
// writes in its forward and backward, per method, counted from the operators' operands and
// results as they run (tempo::memory::TrafficScope), so that every fusion and every technique's
// effect on data movement is a number. The layer runs a batch of --batch sequences (the
// weights' traffic is shared by the batch, as in training); totals are also given per sequence.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "bench.h"
#include "tempo/models/transformer.h"

namespace tempo::tools {

using memory::format_bytes;

std::vector<memory::OpTraffic> layer_traffic(const BenchOptions& o, const models::ModelConfig& c,
                                             const std::string& method) {
  const c10::Device device(o.device == "cuda" ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU));
  const auto dtype = o.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  torch::manual_seed(0);
  const auto mp = models::Method::parse(method);
  models::TransformerLayer layer(c, std::make_shared<const models::MethodOps>(mp));
  layer->to(device, dtype);
  layer->train();
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  const at::Tensor x = at::randn({o.batch, o.seq, c.hidden}, opts).requires_grad_(true);
  const at::Tensor dy = at::randn({o.batch, o.seq, c.hidden}, opts);
  memory::TrafficScope scope("forward");
  at::Tensor y = layer->forward(x, at::Tensor());
  scope.set_phase("backward");
  y.backward(dy);
  return scope.ops();
}

int64_t traffic_total(const std::vector<memory::OpTraffic>& ops, const std::string& phase) {
  int64_t sum = 0;
  for (const auto& t : ops)
    if (phase.empty() || t.phase == phase) sum += t.read + t.written;
  return sum;
}

void print_data_movement(const BenchOptions& o, const models::ModelConfig& c) {
  std::vector<std::pair<std::string, std::vector<memory::OpTraffic>>> all;
  for (const auto& p : o.methods) all.emplace_back(p, layer_traffic(o, c, p));
  std::printf(
      "data movement of one %s layer, forward + backward, batch %lld (S = %lld, %s, %s): bytes each\n"
      "operator reads and writes, from its operands and results (views move nothing)\n",
      c.name.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.seq), o.dtype.c_str(),
      o.device.c_str());
  for (const auto& [method, ops] : all) {
    std::printf("\n%s\n  %-9s %-44s %5s %12s %12s\n", method.c_str(), "pass", "operator", "calls", "read", "written");
    for (const auto& t : ops)
      std::printf("  %-9s %-44s %5lld %12s %12s\n", t.phase.c_str(), t.op.c_str(), static_cast<long long>(t.calls),
                  format_bytes(t.read).c_str(), format_bytes(t.written).c_str());
  }
  const int64_t eager = all.empty() ? 0 : traffic_total(all.front().second);
  std::printf("\n%-16s %14s %14s %14s %14s %10s\n", "method", "forward", "backward", "total", "per sequence",
              ("vs " + (all.empty() ? std::string() : all.front().first)).c_str());
  for (const auto& [method, ops] : all) {
    const int64_t total = traffic_total(ops);
    std::printf(
        "%-16s %14s %14s %14s %14s %9.3fx\n", method.c_str(), format_bytes(traffic_total(ops, "forward")).c_str(),
        format_bytes(traffic_total(ops, "backward")).c_str(), format_bytes(total).c_str(),
        format_bytes(total / o.batch).c_str(), eager ? static_cast<double>(total) / static_cast<double>(eager) : 0.0);
  }
}

}  // namespace tempo::tools
