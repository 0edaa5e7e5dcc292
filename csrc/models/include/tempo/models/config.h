// Model shapes (presets with the published sizes, or custom) and the method: which of
// tempo's techniques a model uses, and the baselines they are compared with.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tempo::models {

enum class Arch { kBert, kRoberta, kGpt2, kLlama };
const char* arch_name(Arch arch);
Arch parse_arch(const std::string& name);  // bert | roberta | gpt2 | llama

struct ModelConfig {
  Arch arch = Arch::kBert;
  std::string name = "custom";
  int64_t vocab = 30522;
  int64_t hidden = 768;
  int64_t layers = 12;
  int64_t heads = 12;
  int64_t intermediate = 3072;
  int64_t max_positions = 512;
  int64_t type_vocab = 2;  // BERT token types (RoBERTa: 1; GPT-2, LLaMA: none)
  int64_t pad_id = 0;      // RoBERTa: 1 (positions start after it)
  int64_t num_labels = 2;  // sequence-classification head
  double dropout = 0.1;    // hidden dropout
  double attention_dropout = 0.1;
  double eps = 1e-12;  // norm epsilon
  double rope_theta = 10000.0;

  // bert-base, bert-large, roberta-base, roberta-large, gpt2, gpt2-medium, gpt2-large,
  // llama-small (a small LLaMA-shaped model: 8 layers, hidden 512).
  static ModelConfig preset(const std::string& name);
  // The architecture's defaults (token types, padding id, norm eps, dropout), with the
  // default sizes above: the one place they live, for presets and custom shapes alike.
  static ModelConfig for_arch(Arch arch);
  static std::vector<std::string> presets();
  // Sizes given as nonzero replace the config's (0 keeps one).
  void resize(int64_t hidden, int64_t layers, int64_t heads, int64_t intermediate, int64_t positions = 0,
              int64_t vocab = 0);
  // A clear error for an inconsistent shape (hidden not divisible by heads, zero layers, ...).
  void validate() const;
  int64_t head_dim() const { return hidden / heads; }
  // The parameters TransformerModel(*this) has (tests check it against built models): what a
  // model needs can be known, and refused, before anything is allocated.
  int64_t parameter_count() const;
};

// A method: what the model keeps for backward (docs/architecture.md's glossary), spelled as the
// Python tempo.methods spells it, <base>[+part ...], with "-change" to turn a change off. Bases:
//   eager       the paper's baseline: eager attention, byte dropout masks, torch GELU and norms
//   sdpa        eager with torch's scaled_dot_product_attention
//   tempo       in-place GELU/SiLU and norms, bit masks (post-LN: fused bias-dropout-residual-
//               LayerNorm), the LM head fused with the loss (tempo::linear_cross_entropy: no
//               logits kept); attention "auto": torch's sdpa where torch has a fused kernel for
//               the inputs, else tempo's attention (output-only softmax, dropout recomputation),
//               the one that keeps fewer bytes (tempo.methods' tempo: attention="auto")
//   tempo-sdpa  tempo with fused attention (no S^2 tensor): torch's scaled_dot_product_attention
//               where torch has a fused kernel for the inputs, else tempo::fused_attention (on
//               CPU with attention dropout torch's sdpa would fall back to its math path)
//   tempo-fused tempo with tempo's attention and the Data Movement paper's fused layer kernels
// Changes, "+c" on and "-c" off: gelu, norm, dropout (bit masks), attention (tempo's attention),
// sdpa, fused, ckpt (each layer recomputed from its input in backward, RNG replayed), head (the
// fused LM head), kernels, recompute-attention (the q/k/v projection and attention core
// recomputed from the layer's input), recompute-up / recompute-gate_up (the gated MLP's); e.g.
// "eager+ckpt", "tempo+attention" (the Tempo paper's attention), "eager+gelu" (in-place GELU
// alone, for the paper's ablation) or "tempo-norm". The parts and recipes of tempo.methods that
// belong to a transformers model (ckpt-offload, offload, trl-head, torch-lce, compile, liger;
// trl, trl-offload, hf-offload) are refused by name, with why.
// Earlier spellings are taken with a deprecation warning: "checkpoint" (eager+ckpt),
// "+checkpoint" (+ckpt), "+recompute" (+recompute-attention), "+mlp_up", "+mlp_gate_up".
struct Method {
  std::string name = "eager";
  std::string attention = "eager";  // eager | tempo | sdpa | fused | auto (SelfAttention backends)
  bool inplace_gelu = false;        // GELU; SwiGLU by tempo::gated_mlp (gate and up kept)
  bool inplace_norm = false;        // LayerNorm, RMSNorm
  bool bit_dropout = false;         // hidden dropout keeps 1 bit per element
  bool checkpoint = false;
  bool fused_head = false;  // LM head + loss by tempo::linear_cross_entropy (no logits kept)
  // The Data Movement paper's fused layer kernels: projections without their bias add, the bias
  // fused into what follows (q/k/v: tempo::qkv_split; fc1: the activation; out and fc2: the
  // bias-dropout-residual-LayerNorm), the bias gradients summed in those kernels' backward.
  bool fused_kernels = false;
  // Recompute the q/k/v projection and the attention core in the backward (change
  // `recompute-attention`): each layer keeps its input instead of q, k, v
  // (SelfAttentionOptions::recompute).
  bool recompute_attention = false;
  // What the gated MLP's backward recomputes (changes `recompute-up`, `recompute-gate_up`): "product" (no
  // matmul), "up" or "gate_up" (tempo::gated_mlp's recompute: one or two GEMMs for one or both
  // intermediate-wide tensors fewer kept).
  std::string mlp_recompute = "product";

  static Method parse(const std::string& spec);
  static std::vector<std::string> names();  // the five bases
};
using MemoryPolicy [[deprecated("tempo::models::MemoryPolicy is spelled tempo::models::Method")]] = Method;

}  // namespace tempo::models
