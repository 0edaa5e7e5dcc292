// The `tempo` operator namespace. Each op file adds its schemas with TORCH_LIBRARY_FRAGMENT.
#include <torch/library.h>

TORCH_LIBRARY(tempo, m) {}
