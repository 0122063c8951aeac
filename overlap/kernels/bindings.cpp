// Python bindings of overlap's CPU kernels (one extension module per ISA variant).
#include <torch/extension.h>
#include "head_step.h"
#include "kernels.h"

namespace py = pybind11;

PackedMatmul packed_matmul(torch::Tensor packed, c10::optional<torch::Tensor> scale, int64_t n,
                           c10::optional<torch::Tensor> bias) {
  return PackedMatmul{packed, scale.value_or(torch::Tensor()), bias.value_or(torch::Tensor()), n};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "a weight [N, K] in the linear kernel's packed layout");
  m.def("linear", &linear, "batch-invariant bf16 linear on a packed weight (linear_bf16.cpp)");
  m.def("pack_int8", &pack_int8, "an int8 weight [N, K] in the int8 kernel's packed layout");
  m.def("linear_int8", &linear_int8, "weight-only int8 linear for drafters (linear_int8.cpp)");
  m.def("set_fma_pairs", &set_fma_pairs, "variant 2's bf16 arithmetic: f32 FMAs on widened pairs (true) or vdpbf16ps");
  m.def("fma_pairs", &fma_pairs, "whether this process's bf16 linear runs the fma arithmetic");
  m.def("set_prefetch_l2", &set_prefetch_l2, "the linear kernels' tiles prefetch the next block into L2 (true) or L1");
  m.def("prefetch_l2", &prefetch_l2, "whether this process's tiles prefetch into L2");
  m.def("variant", &variant, "the ISA variant this build was compiled for");
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention (attention.cpp)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("q_start"),
        pybind11::arg("q_len"), pybind11::arg("kv_len"), pybind11::arg("page_table"), pybind11::arg("page_size"),
        pybind11::arg("tree"), pybind11::arg("scale"), pybind11::arg("reference") = false,
        pybind11::arg("v_pairs") = pybind11::none());
  m.def("sync_value_pairs", &sync_value_pairs, "the value cache's key-pair copy at some slots (attention.cpp)");
  m.def("rms_norm", &rms_norm, "fused bf16 RMSNorm (layer_ops.cpp)");
  m.def("silu_mul", &silu_mul, "SwiGLU: silu(gate) * up (layer_ops.cpp)");
  m.def("rotary_", &rotary_, "rotary embedding in place on q and k heads (layer_ops.cpp)");
  m.def("spread_columns", &spread_columns, "a trimmed vocabulary's scores into full rows, -inf elsewhere (layer_ops.cpp)");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of f32 rows, vectorised (layer_ops.cpp)");
  m.def("tree_walk_greedy", &tree_walk_greedy, "verify_tree_greedy's walk in one call (tree_walk.cpp)");
  m.def("verify_trees_greedy", &verify_trees_greedy, "argmax, walk and top path of a greedy tree step (tree_walk.cpp)");
  m.def("compact_paths", &compact_paths, "accepted paths' KV and hidden states moved into place (tree_walk.cpp)");
  m.def("move_slots",
        [](torch::Tensor k_all, torch::Tensor v_all, c10::optional<torch::Tensor> pairs_all, torch::Tensor src,
           torch::Tensor dst, int64_t page_size) {
          TORCH_CHECK(src.scalar_type() == torch::kLong && dst.scalar_type() == torch::kLong, "move_slots: i64 slots");
          src = src.contiguous(), dst = dst.contiguous();
          const std::vector<int64_t> from(src.data_ptr<int64_t>(), src.data_ptr<int64_t>() + src.numel());
          const std::vector<int64_t> to(dst.data_ptr<int64_t>(), dst.data_ptr<int64_t>() + dst.numel());
          move_slots(k_all, v_all, pairs_all.value_or(torch::Tensor()), from, to, page_size);
        },
        "KV slots moved in every layer, V's pairs kept in step (tree_walk.cpp)");
  py::class_<VersionWatch>(m, "VersionWatch")
      .def(py::init([](std::vector<torch::Tensor> tensors) { return VersionWatch{std::move(tensors)}; }))
      .def("sum", &VersionWatch::sum, "the tensors' version counters, summed");
  py::class_<PackedMatmul>(m, "PackedMatmul");
  m.def("packed_matmul", &packed_matmul, "one matmul of a fused call: packed weight, int8 scales or None, columns, bias",
        py::arg("packed"), py::arg("scale"), py::arg("n"), py::arg("bias"));
  py::class_<DecoderLayerStep>(m, "DecoderLayerStep")
      .def(py::init([](std::vector<PackedMatmul> matmuls, torch::Tensor input_norm, torch::Tensor post_norm,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, double eps) {
        TORCH_CHECK(matmuls.size() == 4, "DecoderLayerStep: qkv, o, gate_up and down matmuls");
        return DecoderLayerStep{matmuls[0], matmuls[1], matmuls[2], matmuls[3], input_norm, post_norm,
                                heads, kv_heads, head_dim, eps};
      }));
  py::class_<ModelStep>(m, "ModelStep")
      .def(py::init([](torch::Tensor embed, std::vector<DecoderLayerStep> layers, torch::Tensor norm_final,
                       PackedMatmul lm_head, torch::Tensor cos, torch::Tensor sin, double eps) {
        return ModelStep{embed, std::move(layers), norm_final, lm_head, cos, sin, eps};
      }))
      // The whole pass runs without the GIL: it touches no Python object.
      .def("forward", &ModelStep::forward, "a decoder's forward in one call (model_step.cpp)",
           py::call_guard<py::gil_scoped_release>());
  py::class_<HeadStep>(m, "HeadStep")
      .def(py::init([](torch::Tensor embed, torch::Tensor norm_embed, torch::Tensor norm_hidden, PackedMatmul fuse,
                       DecoderLayerStep layer, PackedMatmul lm_head, torch::Tensor norm_final, torch::Tensor cos,
                       torch::Tensor sin, torch::Tensor vocab_ids, int64_t vocab, double eps) {
             return HeadStep{embed, norm_embed, norm_hidden, fuse, lm_head, layer, norm_final, cos, sin,
                             vocab_ids, vocab, eps};
           }))
      // The whole call runs without the GIL: it touches no Python object.
      .def("forward",
           [](const HeadStep& step, torch::Tensor ids, torch::Tensor hidden, torch::Tensor positions,
              torch::Tensor k_all, torch::Tensor v_all, torch::Tensor pairs_all, torch::Tensor slots,
              torch::Tensor q_start, torch::Tensor q_len, torch::Tensor kv_len, torch::Tensor page_table,
              int64_t page_size, torch::Tensor tree, c10::optional<torch::Tensor> rows) {
             return step.forward(ids, hidden, positions, k_all, v_all, pairs_all, slots, q_start, q_len, kv_len,
                                 page_table, page_size, tree, rows);
           },
           "the head's forward in one call (head_step.cpp)", py::call_guard<py::gil_scoped_release>())
      .def("forward_seqs",
           [](const HeadStep& step, torch::Tensor ids, const std::vector<torch::Tensor>& hidden,
              const std::vector<int64_t>& positions, torch::Tensor k_all, torch::Tensor v_all, torch::Tensor pairs_all,
              const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens,
              const std::vector<std::vector<int64_t>>& page_tables,
              const std::vector<c10::optional<torch::Tensor>>& tree_masks, int64_t page_size,
              const std::vector<int64_t>& rows) {
             return step.forward_seqs(ids, hidden, positions, k_all, v_all, pairs_all, q_lens, kv_lens, page_tables,
                                      tree_masks, page_size, rows);
           },
           "the same, planned from the step's lists (head_step.cpp)", py::call_guard<py::gil_scoped_release>())
      .def("forward_seqs",
           [](const HeadStep& step, const std::vector<int64_t>& ids, const std::vector<torch::Tensor>& hidden,
              const std::vector<int64_t>& positions, torch::Tensor k_all, torch::Tensor v_all, torch::Tensor pairs_all,
              const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens,
              const std::vector<std::vector<int64_t>>& page_tables,
              const std::vector<c10::optional<torch::Tensor>>& tree_masks, int64_t page_size,
              const std::vector<int64_t>& rows) {
             return step.forward_seqs(long_tensor(ids), hidden, positions, k_all, v_all, pairs_all,
                                      q_lens, kv_lens, page_tables, tree_masks, page_size, rows);
           },
           "the same with the ids as a list", py::call_guard<py::gil_scoped_release>())
      .def("expand_tree", &HeadStep::expand_tree, "an EAGLE tree's expansion in one call (head_step.cpp)",
           py::call_guard<py::gil_scoped_release>());
  py::class_<TreePlan>(m, "TreePlan")
      .def(py::init([](const std::vector<py::tuple>& levels, int64_t num_nodes, int64_t top_k) {
        // levels: (draws [(parent, children, ranks)], rows, row_index, row_parents, mask, depth_offsets)
        TreePlan plan;
        plan.num_nodes = num_nodes;
        plan.top_k = top_k;
        for (const auto& l : levels) {
          TreeLevel level;
          for (const auto& d : l[0].cast<std::vector<py::tuple>>()) {
            level.parents.push_back(d[0].cast<int64_t>());
            level.children.push_back(d[1].cast<torch::Tensor>());
            level.ranks.push_back(d[2].cast<torch::Tensor>());
          }
          level.rows = l[1].cast<std::vector<int64_t>>();
          level.row_index = l[2].cast<torch::Tensor>();
          level.row_parents = l[3].cast<std::vector<int64_t>>();
          level.mask = l[4].cast<c10::optional<torch::Tensor>>();
          level.depth_offsets = l[5].cast<std::vector<int64_t>>();
          plan.levels.push_back(std::move(level));
        }
        return plan;
      }));
}
