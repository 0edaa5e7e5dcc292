#include "tempo/train/distributed.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <limits>
#include <unordered_set>

#if TEMPO_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif
#if TEMPO_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

namespace tempo::train {

namespace {
[[maybe_unused]] void check_group(int rank, int world, int port) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tempo::train: rank ", rank, " of ", world, " is not valid");
  TORCH_CHECK(port > 0 && port < 65536, "tempo::train: MASTER_PORT ", port, " is not a port");
}

#if TEMPO_WITH_GLOO || TEMPO_WITH_NCCL
// The rendezvous: rank 0 serves a TCPStore at addr:port, the others join it.
c10::intrusive_ptr<c10d::Store> make_store(int rank, int world, const std::string& addr, int port) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = rank == 0;
  so.numWorkers = world;
  so.timeout = std::chrono::seconds(300);
  return c10::make_intrusive<c10d::TCPStore>(addr, so);
}
#endif
}  // namespace

#if TEMPO_WITH_GLOO
namespace {
class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(int rank, int world, const std::string& addr, int port) : rank_(rank), world_(world) {
    auto store = make_store(rank, world, addr, port);
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(addr));
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  bool distributed() const override { return true; }
  std::function<void()> allreduce_sum_start(at::Tensor t) override {
    std::vector<at::Tensor> one{t};
    auto work = pg_->allreduce(one);
    return [work] { work->wait(); };
  }
  void barrier() override { pg_->barrier()->wait(); }

 private:
  int rank_, world_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};
}  // namespace

bool gloo_available() { return true; }
std::unique_ptr<Communicator> make_gloo_communicator(int rank, int world, const std::string& addr, int port) {
  check_group(rank, world, port);
  return std::make_unique<GlooCommunicator>(rank, world, addr, port);
}
#else
bool gloo_available() { return false; }
std::unique_ptr<Communicator> make_gloo_communicator(int, int, const std::string&, int) {
  TORCH_CHECK(false,
              "tempo::train: built without Gloo's headers, so no data parallelism "
              "(install libgloo-dev and rebuild)");
}
#endif

#if TEMPO_WITH_NCCL
namespace {
class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int world, const std::string& addr, int port, int local_rank)
      : rank_(rank), world_(world), device_(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank)) {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));
    pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(make_store(rank, world, addr, port), rank, world);
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  bool distributed() const override { return true; }
  // NCCL sums device tensors; a CPU tensor goes through the device and back.
  std::function<void()> allreduce_sum_start(at::Tensor t) override {
    at::Tensor d = t.is_cuda() ? t : t.to(device_);
    std::vector<at::Tensor> one{d};
    auto work = pg_->allreduce(one);
    return [work, t, d]() mutable {
      work->wait();
      if (!t.is_cuda()) t.copy_(d);
    };
  }
  void barrier() override { pg_->barrier()->wait(); }

 private:
  int rank_, world_;
  c10::Device device_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
};
}  // namespace

bool nccl_available() { return true; }
std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world, const std::string& addr, int port,
                                                     int local_rank) {
  check_group(rank, world, port);
  return std::make_unique<NcclCommunicator>(rank, world, addr, port, local_rank);
}
#else
bool nccl_available() { return false; }
std::unique_ptr<Communicator> make_nccl_communicator(int, int, const std::string&, int, int) {
  TORCH_CHECK(false,
              "tempo::train: built without NCCL (a CUDA torch and nccl.h are needed), so no data "
              "parallelism on CUDA");
}
#endif

namespace {
constexpr size_t kNone = std::numeric_limits<size_t>::max();

struct GradientFinalHook : torch::autograd::PostAccumulateGradHook {
  GradientFinalHook(GradientReducer* r, size_t i) : reducer(r), index(i) {}
  void operator()(const torch::autograd::Variable&) override { reducer->on_gradient_final(index); }
  GradientReducer* reducer;
  size_t index;
};
}  // namespace

GradientReducer::GradientReducer(std::vector<at::Tensor> params, Communicator& comm, int64_t bucket_bytes, bool overlap)
    : comm_(comm), bucket_bytes_(std::max<int64_t>(bucket_bytes, 1)), overlap_(overlap) {
  std::unordered_set<const void*> seen;  // a tied weight is listed under each of its names: reduce it once
  for (auto& p : params)
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params_.push_back(p);
  if (overlap_)
    for (size_t i = 0; i < params_.size(); ++i)
      torch::autograd::impl::set_post_acc_grad_hooks(params_[i], std::make_unique<GradientFinalHook>(this, i));
  else {  // buckets in reverse declaration order (roughly the backward's), fixed from the start
    std::vector<size_t> order(params_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
    plan(order, order.size());
  }
}

GradientReducer::~GradientReducer() {
  if (overlap_)
    for (auto& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

void GradientReducer::plan(const std::vector<size_t>& order, size_t used) {
  buckets_.assign(1, Bucket{});
  bucket_of_.assign(params_.size(), kNone);
  int64_t bytes = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    const int64_t b = params_[i].numel() * static_cast<int64_t>(params_[i].element_size());
    // A new bucket when this one is full, and where the parameters that got no gradient begin
    // (they would hold back the bucket they share).
    if (bytes > 0 && (bytes + b > bucket_bytes_ || k == used)) buckets_.emplace_back(), bytes = 0;
    buckets_.back().members.push_back(i);
    bucket_of_[i] = buckets_.size() - 1;
    bytes += b;
  }
  if (buckets_.back().members.empty()) buckets_.pop_back();
}

void GradientReducer::prepare() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& b : buckets_) b.ready = 0, b.started = false, b.flat = at::Tensor(), b.wait = nullptr;
  next_ = 0;
  final_order_.clear();
  armed_ = true;
}

void GradientReducer::start(Bucket& b) {
  // Every member takes its place in the flat tensor, zeros where this rank has no gradient,
  // so that the collectives have the same sizes on every rank.
  std::vector<at::Tensor> parts;
  for (size_t i : b.members) {
    const auto& g = params_[i].grad();
    parts.push_back(g.defined() ? g.reshape(-1) : at::zeros({params_[i].numel()}, params_[i].options()));
  }
  b.flat = at::cat(parts);
  b.wait = comm_.allreduce_sum_start(b.flat);
  b.started = true;
}

void GradientReducer::on_gradient_final(size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_) return;
  if (buckets_.empty()) {  // the first step: learn the order
    final_order_.push_back(i);
    return;
  }
  auto& b = buckets_[bucket_of_[i]];
  ++b.ready;
  while (next_ < buckets_.size() && buckets_[next_].ready == buckets_[next_].members.size()) start(buckets_[next_++]);
}

void GradientReducer::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_ = false;
  started_in_backward_ = next_;
  if (buckets_.empty()) {
    // The order every rank uses from now on: rank 0's (then any parameter that got no gradient).
    std::vector<size_t> order = final_order_;
    int64_t used = static_cast<int64_t>(order.size());
    std::vector<char> in(params_.size(), 0);
    for (size_t i : order) in[i] = 1;
    for (size_t i = params_.size(); i-- > 0;)
      if (!in[i]) order.push_back(i);
    at::Tensor shared = at::zeros({static_cast<int64_t>(order.size()) + 1}, at::kLong);
    auto acc = shared.accessor<int64_t, 1>();
    if (comm_.rank() == 0) {
      for (size_t k = 0; k < order.size(); ++k) acc[static_cast<int64_t>(k)] = static_cast<int64_t>(order[k]);
      acc[static_cast<int64_t>(order.size())] = used;
    }
    std::vector<at::Tensor> one{shared};
    comm_.allreduce_sum(one);
    for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<size_t>(acc[static_cast<int64_t>(k)]);
    plan(order, static_cast<size_t>(acc[static_cast<int64_t>(order.size())]));
  }
  for (; next_ < buckets_.size(); ++next_) start(buckets_[next_]);
  for (auto& b : buckets_) {
    b.wait();
    int64_t off = 0;
    for (size_t i : b.members) {
      auto g = params_[i].grad();
      const int64_t n = params_[i].numel();
      if (g.defined()) g.copy_(b.flat.narrow(0, off, n).view_as(g));
      off += n;
    }
    b.flat = at::Tensor(), b.wait = nullptr;
  }
  next_ = 0;
}

}  // namespace tempo::train
