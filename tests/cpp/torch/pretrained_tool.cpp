// A helper of tests/python/cli/test_pretrained.py (not installed): runs the C++ side of the
// comparisons with transformers.
//   pretrained_tool hidden DIR POLICY IN.safetensors OUT.safetensors
//       loads DIR, runs input_ids/attention_mask of IN in eval mode, writes "hidden" to OUT
//       and prints the load report (fresh, unused, notes) as lines "fresh NAME", ...
//   pretrained_tool grads DIR POLICY_A POLICY_B IN.safetensors
//       loads DIR under both methods, runs the masked-LM loss of IN (input_ids,
//       attention_mask, labels) in train mode (dropout on, the same seed) and backward, and
//       prints "loss A B" and "worst_rel_grad X NAME" (the largest relative L2 difference of a
//       parameter's gradient)
//   pretrained_tool save DIR OUT_DIR   loads DIR and saves it again with save_pretrained
//   pretrained_tool make ARCH OUT_DIR  saves a small random model of ARCH (bert, roberta,
//       gpt2, llama) for transformers to load
#include <algorithm>
#include <cstdio>
#include <string>

#include "tempo/models.h"

using namespace tempo::models;

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "hidden" && argc == 6) {
      LoadReport report;
      TransformerModel m = load_pretrained(argv[2], Method::parse(argv[3]), &report);
      m->eval();
      auto in = read_safetensors(argv[4]);
      at::Tensor mask = in.count("attention_mask") ? in.at("attention_mask") : at::Tensor();
      at::NoGradGuard no_grad;
      const at::Tensor h = m->hidden_states(in.at("input_ids"), mask);
      write_safetensors(argv[5], {{"hidden", h}});
      for (const auto& s : report.fresh) std::printf("fresh %s\n", s.c_str());
      for (const auto& s : report.unused) std::printf("unused %s\n", s.c_str());
      for (const auto& s : report.notes) std::printf("note %s\n", s.c_str());
      return 0;
    }
    if (cmd == "grads" && argc == 6) {
      auto in = read_safetensors(argv[5]);
      Batch batch;
      batch.input_ids = in.at("input_ids");
      batch.attention_mask = in.at("attention_mask");
      batch.labels = in.at("labels");
      double loss[2];
      std::vector<std::pair<std::string, at::Tensor>> grads[2];
      for (int i = 0; i < 2; ++i) {
        torch::manual_seed(7);  // the same fresh masked-LM head for both
        TransformerModel m = load_pretrained(argv[2], Method::parse(argv[3 + i]));
        m->train();
        torch::manual_seed(11);
        at::Tensor l = m->loss(batch);
        l.backward();
        loss[i] = l.item<double>();
        for (const auto& p : m->named_parameters())
          grads[i].emplace_back(p.key(), p.value().grad().defined() ? p.value().grad() : at::zeros_like(p.value()));
      }
      double worst = 0;
      std::string where;
      for (size_t k = 0; k < grads[0].size(); ++k) {
        const at::Tensor a = grads[0][k].second.to(at::kDouble), b = grads[1][k].second.to(at::kDouble);
        const double ref = a.norm().item<double>();
        const double rel = (a - b).norm().item<double>() / std::max(ref, 1e-30);
        if (ref > 0 && rel > worst) worst = rel, where = grads[0][k].first;
      }
      std::printf("loss %.9g %.9g\nworst_rel_grad %.3e %s\n", loss[0], loss[1], worst, where.c_str());
      return 0;
    }
    if (cmd == "save" && argc == 4) {
      TransformerModel m = load_pretrained(argv[2]);
      save_pretrained(m, argv[3]);
      return 0;
    }
    if (cmd == "make" && argc == 4) {
      ModelConfig c = ModelConfig::for_arch(parse_arch(argv[2]));
      c.vocab = 97, c.hidden = 32, c.layers = 2, c.heads = 4, c.intermediate = 48, c.max_positions = 40;
      torch::manual_seed(3);
      TransformerModel m(c, Method::parse("eager"));
      {  // non-trivial norms and biases, so that a mix-up of names shows
        at::NoGradGuard no_grad;
        for (auto& p : m->parameters()) p.add_(at::randn_like(p) * 0.05);
      }
      save_pretrained(m, argv[3]);
      return 0;
    }
    std::fprintf(stderr,
                 "usage: pretrained_tool hidden DIR POLICY IN OUT | grads DIR POLICY_A POLICY_B IN | save DIR OUT_DIR "
                 "| make ARCH OUT_DIR\n");
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 1;
  }
}
