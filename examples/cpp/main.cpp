// Trains a small MLP with tempo::nn::GELU for a few steps and checks it against the same
// MLP with torch::nn::GELU from the same initial weights: exits non-zero on a mismatch.
#include <c10/util/Logging.h>
#include <tempo/nn.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  FLAGS_caffe2_use_fatal_for_enforce = false;  // failed checks throw c10::Error rather than abort
  torch::manual_seed(0);
  auto make = [](torch::nn::AnyModule act) {
    torch::manual_seed(0);
    torch::nn::Sequential mlp(torch::nn::Linear(8, 32));
    mlp->push_back(std::move(act));
    mlp->push_back(torch::nn::Linear(32, 1));
    return mlp;
  };
  auto ours = make(torch::nn::AnyModule(tempo::nn::GELU()));
  auto ref = make(torch::nn::AnyModule(torch::nn::GELU()));
  torch::optim::SGD opt_ours(ours->parameters(), 0.05), opt_ref(ref->parameters(), 0.05);
  auto x = torch::randn({64, 8});
  auto target = x.sum(1, true).sin();
  double worst = 0;
  for (int step = 0; step < 20; ++step) {
    auto l1 = torch::mse_loss(ours->forward(x), target);
    auto l2 = torch::mse_loss(ref->forward(x), target);
    opt_ours.zero_grad();
    opt_ref.zero_grad();
    l1.backward();
    l2.backward();
    opt_ours.step();
    opt_ref.step();
    worst = std::max(worst, std::abs(l1.item<double>() - l2.item<double>()) / l2.item<double>());
  }
  std::printf("tempo_example: 20 SGD steps, largest relative loss difference %.3g\n", worst);
  return worst <= 1e-4 ? 0 : 1;
}
