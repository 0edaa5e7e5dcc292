#include "tempo/train/distributed.h"

#include <c10/util/Exception.h>

#if TEMPO_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

namespace tempo::train {

#if TEMPO_WITH_GLOO
namespace {
class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(int rank, int world, const std::string& addr, int port) : rank_(rank), world_(world) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = rank == 0;
    so.numWorkers = world;
    so.timeout = std::chrono::seconds(300);
    auto store = c10::make_intrusive<c10d::TCPStore>(addr, so);
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(addr));
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  // One collective per tensor, all in flight at once (the buckets of a step's gradients).
  void allreduce_sum(std::vector<at::Tensor>& tensors) override {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      works.push_back(pg_->allreduce(one));
    }
    for (auto& w : works) w->wait();
  }
  void barrier() override { pg_->barrier()->wait(); }

 private:
  int rank_, world_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};
}  // namespace

bool gloo_available() { return true; }
std::unique_ptr<Communicator> make_gloo_communicator(int rank, int world, const std::string& addr, int port) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "tempo::train: rank ", rank, " of ", world, " is not valid");
  TORCH_CHECK(port > 0 && port < 65536, "tempo::train: MASTER_PORT ", port, " is not a port");
  return std::make_unique<GlooCommunicator>(rank, world, addr, port);
}
#else
bool gloo_available() { return false; }
std::unique_ptr<Communicator> make_gloo_communicator(int, int, const std::string&, int) {
  TORCH_CHECK(false, "tempo::train: built without Gloo's headers, so no data parallelism "
              "(install libgloo-dev and rebuild)");
}
#endif

}  // namespace tempo::train
