// C++ API of tempo's dropout: the backward keeps a 1-bit packed mask ("bits") or only the
// 16-byte Philox state and regenerates the mask ("philox"). torch.manual_seed /
// torch::manual_seed fix the masks, and CPU and CUDA draw the same ones.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace tempo {

// As torch::nn::functional::dropout: x itself when !train or p == 0, zeros for p = 1, else
// x * keep / (1 - p). p outside [0, 1] or an unknown mode: an error.
at::Tensor dropout(const at::Tensor& x, double p, bool train = true, c10::string_view mode = "bits");

// The ops behind it. dropout_forward returns (y, keep): keep is what the backward needs, the
// ceil(numel / 8) packed keep bits (uint8) in bits mode, the int64 Philox state
// {seed, offset} in philox mode.
std::tuple<at::Tensor, at::Tensor> dropout_forward(const at::Tensor& x, double p, c10::string_view mode);
at::Tensor dropout_backward(const at::Tensor& grad, const at::Tensor& keep, double p, c10::string_view mode);

}  // namespace tempo
