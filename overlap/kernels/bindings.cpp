// Python bindings of overlap's CPU kernels (one extension module per ISA variant).
#include <torch/extension.h>

torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                     bool out_float);
int variant();
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor q_start, torch::Tensor q_len, torch::Tensor kv_len,
                              torch::Tensor page_table, int64_t page_size, torch::Tensor tree,
                              double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "batch-invariant bf16 linear (linear_bf16.cpp)");
  m.def("variant", &variant, "the ISA variant this build was compiled for");
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention (attention.cpp)");
}
