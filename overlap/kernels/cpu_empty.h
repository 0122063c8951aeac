// New CPU tensors without torch's dispatch: at::empty's own CPU kernel, called directly. A
// target pass allocates ~250 outputs (every linear, norm, attention and SwiGLU of 30 layers)
// and the dispatcher's share of each (~0.5 us) added up to ~0.1 ms a pass.
#pragma once
#include <ATen/EmptyTensor.h>
#include <torch/extension.h>

inline torch::Tensor cpu_empty(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  return at::Tensor(at::detail::empty_cpu(sizes, dtype));
}
