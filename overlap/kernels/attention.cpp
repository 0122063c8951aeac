// Paged attention for the CPU, batch-invariant by construction.
//
// Every query row (sequence b, new token i, head h) is computed by the same loop whatever
// else is in the step: scores over its visible keys in ascending key order (a fixed-width
// partial-sum dot product, then a fixed-order lane sum), a two-pass softmax in f32, and the
// weighted sum of values in ascending key order. So a token's attention output is the same
// bits in a prefill, a verify pass over k+1 rows, a tree verify, a decode step or any batch.
// No context gather, no mask tensor, no f64: keys and values are read in place from the
// paged pool through the page table.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "pool.h"
#include "fixed_exp.h"
#include <c10/util/BFloat16.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int LANES = 16;   // partial sums per dot product (vectorised by the compiler)
constexpr int MAX_DIM = 256;

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}

// q · k over dim elements: LANES independent partial sums, then a fixed pairwise tree.
inline float dot(const float* q, const float* k, int64_t dim) {
  float part[LANES] = {0};
  int64_t d = 0;
  for (; d + LANES <= dim; d += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += q[d + l] * k[d + l];
  for (int l = 0; d < dim; ++d, ++l) part[l] += q[d] * k[d];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

template <typename T>
void run(const T* q, const T* kc, const T* vc, T* out, const int32_t* q_start,
         const int32_t* q_len, const int32_t* kv_len, const int32_t* table, int64_t max_pages,
         int64_t page_size, const bool* tree, int64_t tree_cols, int64_t num_seqs,
         int64_t heads, int64_t kv_heads, int64_t dim, float scale, int64_t rows_per_task) {
  const int64_t group = heads / kv_heads;
  // Tasks: (sequence, kv head, block of query rows). The rows of a block share each key and
  // value load; the split never changes a row's own arithmetic (see below).
  std::vector<int64_t> task_seq, task_row;
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t r = 0; r < q_len[b]; r += rows_per_task) {
      task_seq.push_back(b);
      task_row.push_back(r);
    }
  const int64_t tasks = int64_t(task_seq.size()) * kv_heads;
  overlap::parallel_for(tasks, 2, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, qf, acc, max_s, total, kf(dim), vf(dim);
    std::vector<int64_t> visible_end;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = task_seq[t / kv_heads], kvh = t % kv_heads;
      const int64_t i0 = task_row[t / kv_heads], i1 = std::min<int64_t>(i0 + rows_per_task, q_len[b]);
      const int64_t rows = i1 - i0, nq = rows * group;
      const int64_t prefix = kv_len[b] - q_len[b];
      const int32_t* pages = table + b * max_pages;
      // Row i (of its sequence) sees keys 0..prefix+i causally, or the prefix plus the tree
      // nodes its mask row allows: its own visibility, whatever else is in the block.
      visible_end.resize(rows);
      for (int64_t ii = 0; ii < rows; ++ii) visible_end[ii] = tree ? kv_len[b] : prefix + i0 + ii + 1;
      const int64_t span = visible_end[rows - 1] > visible_end[0] ? visible_end[rows - 1] : visible_end[0];
      auto visible = [&](int64_t ii, int64_t j) {
        if (j >= visible_end[ii]) return false;
        return !tree || j < prefix || tree[(q_start[b] + i0 + ii) * tree_cols + (j - prefix)];
      };
      qf.resize(nq * dim);
      for (int64_t ii = 0; ii < rows; ++ii)
        for (int64_t g = 0; g < group; ++g)
          to_float(q + ((q_start[b] + i0 + ii) * heads + kvh * group + g) * dim, qf.data() + (ii * group + g) * dim, dim);
      // 1. scores of every visible key, each key loaded once for the block.
      scores.assign(nq * span, 0.f);
      for (int64_t j = 0; j < span; ++j) {
        const int64_t slot = int64_t(pages[j / page_size]) * page_size + j % page_size;
        to_float(kc + (slot * kv_heads + kvh) * dim, kf.data(), dim);
        for (int64_t ii = 0; ii < rows; ++ii) {
          if (!visible(ii, j)) continue;
          for (int64_t g = 0; g < group; ++g)
            scores[(ii * group + g) * span + j] = dot(qf.data() + (ii * group + g) * dim, kf.data(), dim) * scale;
        }
      }
      // 2. per row and head: the max over its visible keys, then exp and their sum in key order.
      max_s.assign(nq, -std::numeric_limits<float>::infinity());
      total.assign(nq, 0.f);
      for (int64_t ii = 0; ii < rows; ++ii)
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + (ii * group + g) * span;
          float& m = max_s[ii * group + g];
          if (!tree) {  // causal: the row sees keys 0 .. visible_end - 1, a plain loop
            const int64_t end = visible_end[ii];
            for (int64_t j = 0; j < end; ++j) m = std::max(m, s[j]);
            for (int64_t j = 0; j < end; ++j) s[j] = overlap::fixed_exp(s[j] - m);
            for (int64_t j = 0; j < end; ++j) total[ii * group + g] += s[j];
            continue;
          }
          for (int64_t j = 0; j < span; ++j)
            if (visible(ii, j)) m = std::max(m, s[j]);
          for (int64_t j = 0; j < span; ++j)
            if (visible(ii, j)) {
              s[j] = overlap::fixed_exp(s[j] - m);
              total[ii * group + g] += s[j];
            }
        }
      // 3. weighted values in key order, each value loaded once for the block.
      acc.assign(nq * dim, 0.f);
      for (int64_t j = 0; j < span; ++j) {
        const int64_t slot = int64_t(pages[j / page_size]) * page_size + j % page_size;
        to_float(vc + (slot * kv_heads + kvh) * dim, vf.data(), dim);
        for (int64_t ii = 0; ii < rows; ++ii) {
          if (!visible(ii, j)) continue;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[(ii * group + g) * span + j];
            float* a = acc.data() + (ii * group + g) * dim;
            for (int64_t d = 0; d < dim; ++d) a[d] += p * vf[d];
          }
        }
      }
      for (int64_t ii = 0; ii < rows; ++ii)
        for (int64_t g = 0; g < group; ++g) {
          T* o = out + ((q_start[b] + i0 + ii) * heads + kvh * group + g) * dim;
          const float inv = 1.f / total[ii * group + g];
          const float* a = acc.data() + (ii * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] = T(a[d] * inv);
        }
    }
  });
}

}  // namespace

// q [T, H, D]; k_cache, v_cache [slots, Hkv, D] (the flat paged pool); per sequence b:
// q_start, q_len, kv_len [B] i32, page_table [B, max_pages] i32; tree [T, Qmax] bool or an
// empty tensor (causal): row t's visibility of its own sequence's new tokens.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor q_start, torch::Tensor q_len, torch::Tensor kv_len,
                              torch::Tensor page_table, int64_t page_size, torch::Tensor tree,
                              double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2),
              "paged_attention: q [T, H, D] and caches [slots, Hkv, D]");
  TORCH_CHECK(q.size(2) <= MAX_DIM, "paged_attention: head_dim > ", MAX_DIM);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and caches must share a dtype");
  for (auto* t : {&q_start, &q_len, &kv_len, &page_table})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "paged_attention: int32 metadata");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "paged_attention: heads must be a multiple of kv heads");
  const bool has_tree = tree.defined() && tree.numel() > 0;
  if (has_tree) TORCH_CHECK(tree.scalar_type() == torch::kBool && tree.is_contiguous() && tree.size(0) == q.size(0));
  const int64_t rows_per_task = 16;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    run<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                  out.data_ptr<scalar_t>(), q_start.data_ptr<int32_t>(), q_len.data_ptr<int32_t>(),
                  kv_len.data_ptr<int32_t>(), page_table.data_ptr<int32_t>(), page_table.size(1),
                  page_size, has_tree ? tree.data_ptr<bool>() : nullptr, has_tree ? tree.size(1) : 0,
                  q_start.size(0), heads, kv_heads, dim, float(scale), rows_per_task);
  });
  return out;
}
