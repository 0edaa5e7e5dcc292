// C++ API of tempo::rope, the rotary position embedding in one pass: x ([batch, heads, seq,
// head_dim], any strides with a contiguous last dimension) rotated by cos and sin ([seq, r],
// [b, seq, r] or [b, 1, seq, r], b 1 or batch, r = rotary_dim even and at most head_dim; x's
// dtype, or float32 for 16-bit x): out = x cos + rotate_half(x) sin over the first r columns,
// the rest passed through, computed in float32 (float64 for float64) and rounded once; the
// output in x's layout where x's last dimension is the innermost (else contiguous). The
// form LLaMA's attention applies to q and k. What it replaces: the five elementwise kernels and
// the concatenation of x cos + rotate_half(x) sin in each direction. Keeps nothing of x for
// backward (the backward is the transposed rotation of the gradient, with the same tables).
#pragma once

#include <ATen/core/Tensor.h>

namespace tempo {

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// dx from the gradient of out (the transposed rotation); itself differentiable (by rope).
at::Tensor rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace tempo
