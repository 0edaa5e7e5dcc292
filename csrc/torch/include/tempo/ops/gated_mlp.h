// C++ API of tempo's gated MLP, down(act(gate(x)) * up(x)): LLaMA/Mistral/Qwen's SwiGLU
// (activation "silu"), Gemma's GeGLU ("gelu_tanh"; "gelu" for the erf form), with separate gate
// and up projections or one fused gate_up projection (Phi-3: up_weight absent, gate_weight
// [2 I, H] with the gate's rows first). For backward it keeps x (the MLP's input, which the norm
// before it keeps anyway), gate(x) and up(x): two I-wide tensors, where autograd keeps four
// (gate, act(gate), up, and their product h for the down projection's weight gradient). The
// backward recomputes h one block at a time (`chunk` intermediate columns by 2^20 / chunk
// rows, at least 1024), so that its transient tensors (h, dh, dgate, dup of a block) stay bounded
// whatever the sequence length; each weight-gradient block sums its row blocks' GEMMs in the
// math type (float32 for 16-bit data), rounded once, and no matmul is recomputed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>

namespace tempo {

// x [..., H]; gate_weight [I, H] (or [2 I, H] without up_weight); up_weight [I, H];
// down_weight [O, I]; biases [I] (gate's: [2 I] when fused; up_bias only with up_weight) and [O];
// activation "silu", "gelu" or "gelu_tanh"; chunk: intermediate columns per backward block
// (0: automatic, H rounded up to 64: as wide as the model's own GEMMs); recompute: "product" (h only: no matmul
// recomputed), "up" (also up(x), one GEMM of the forward's three) or "gate_up" (also gate(x): two). Returns [..., O].
// Every tensor has x's dtype and device (under autocast: the autocast dtype).
at::Tensor gated_mlp(const at::Tensor& x, const at::Tensor& gate_weight, const std::optional<at::Tensor>& up_weight,
                     const at::Tensor& down_weight, const std::optional<at::Tensor>& gate_bias = std::nullopt,
                     const std::optional<at::Tensor>& up_bias = std::nullopt,
                     const std::optional<at::Tensor>& down_bias = std::nullopt, c10::string_view activation = "silu",
                     int64_t chunk = 0, c10::string_view recompute = "product");

// What the backward recomputes besides the product h; gated_mlp_recompute names it (and raises
// on another name).
enum class GatedMlpRecompute { kProduct, kUp, kGateUp };
GatedMlpRecompute gated_mlp_recompute(c10::string_view recompute);

// The ops behind it. forward -> (y, gate [rows, I] (fused: the whole [rows, 2 I] projection),
// up [rows, I] (fused: empty)), as recompute keeps them (recompute "up": up empty, gate [rows, I]
// also when fused; "gate_up": both empty; what is not kept is computed block by block of rows); backward (gate and up:
// what the forward kept, absent where it is recomputed from x; fused: the [rows, 2 I] projection, its gate half [rows,
// I] or absent; gate_bias and up_bias: used only to recompute) -> (dx, d gate_weight, d up_weight, d down_weight, d
// gate_bias, d up_bias, d down_bias), a gradient undefined where output_mask (x, gate_weight, up_weight, down_weight)
// or bias_grad (gate, up, down) says it is not needed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_mlp_forward(
    const at::Tensor& x, const at::Tensor& gate_weight, const std::optional<at::Tensor>& up_weight,
    const at::Tensor& down_weight, const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
    const std::optional<at::Tensor>& down_bias, c10::string_view activation, c10::string_view recompute = "product");
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_mlp_backward(
    const at::Tensor& grad, const at::Tensor& x, const std::optional<at::Tensor>& gate,
    const std::optional<at::Tensor>& up, const at::Tensor& gate_weight, const std::optional<at::Tensor>& up_weight,
    const at::Tensor& down_weight, const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
    std::array<bool, 3> bias_grad, c10::string_view activation, int64_t chunk, std::array<bool, 4> output_mask);

}  // namespace tempo
