// The small per-layer ops of a Llama decoder, fused, for bf16 on the CPU.
//
// In eager torch each of these is 3-8 dispatched ops (RMSNorm alone: to, pow, mean, add,
// rsqrt, mul, to, mul) at a few microseconds each, times 2 per layer, times 30 layers: a
// fixed cost per step that does not shrink with the batch. Here each is one call, rows in
// parallel, and every row is computed by the same fixed-order loop whatever else is in the
// call (batch-invariant by construction). Rounding follows the eager ops step by step (a
// bf16 rounding wherever the eager graph stores a bf16 tensor), so results match
// transformers' bf16 module semantics: normalise in f32, round, scale in bf16.
#include <torch/extension.h>
#include "cpu_empty.h"
#include <algorithm>
#include <limits>
#include <ATen/Parallel.h>
#include "pool.h"
#include "fixed_exp.h"
#include "bf16_vec.h"
#include <c10/util/BFloat16.h>
#include <cmath>

namespace {

using bf16 = c10::BFloat16;

// c10's float -> bf16 rounding (to nearest even, NaN -> 0x7FC0) written branch-free, so the
// loops around it vectorise (bf16(v)'s constructor kept SwiGLU scalar: ~11 ns an element).
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return v != v ? uint16_t(0x7FC0) : uint16_t(rounded);
}
inline float round_bf16(float v) {
  const uint32_t u = uint32_t(bf16_bits(v)) << 16;
  float out;
  std::memcpy(&out, &u, 4);
  return out;
}
inline bf16 to_bf16(float v) { return bf16(bf16_bits(v), bf16::from_bits()); }

// sum of squares of one row: LANES partial sums, then a fixed pairwise tree.
constexpr int LANES = 16;
inline float sum_squares(const float* x, int64_t n) {
  float part[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += x[i + l] * x[i + l];
  for (int l = 0; i < n; ++i, ++l) part[l] += x[i] * x[i];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// out = weight * bf16(x * rsqrt(mean(x^2) + eps)), row by row.
void norm_row(const float* x, const bf16* weight, bf16* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(float(weight[i]) * round_bf16(x[i] * inv));
}

}  // namespace

// x [T, H] bf16, weight [H] bf16 → [T, H] bf16.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16 && x.dim() == 2);
  x = x.contiguous();
  auto out = cpu_empty(x.sizes(), x.scalar_type());
  const int64_t t = x.size(0), h = x.size(1);
  auto xp = reinterpret_cast<const bf16*>(x.data_ptr());
  auto wp = reinterpret_cast<const bf16*>(weight.data_ptr());
  auto op = reinterpret_cast<bf16*>(out.data_ptr());
  overlap::parallel_for(t, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(h);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < h; ++i) row[i] = float(xp[r * h + i]);
      norm_row(row.data(), wp, op + r * h, h, float(eps));
    }
  });
  return out;
}

// gate_up [T, 2I] bf16 → bf16(silu(gate)) * up, [T, I] bf16 (SwiGLU).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16 && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0);
  gate_up = gate_up.contiguous();
  const int64_t t = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = cpu_empty({t, inter}, gate_up.scalar_type());
  auto gp = reinterpret_cast<const bf16*>(gate_up.data_ptr());
  auto op = reinterpret_cast<bf16*>(out.data_ptr());
  overlap::parallel_for(t, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* g = gp + r * 2 * inter;
      const bf16* u = g + inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      // 16 lanes with explicit instructions (the compiler left this loop scalar: ~6 ns an
      // element, 13% of a prefill); the same operations in the same order as the scalar
      // tail below, lane by lane, so the same bits.
      for (; i + 16 <= inter; i += 16) {
        const __m512 gv = overlap::widen_bf16x16(g + i);
        const __m512 e = overlap::fixed_exp16(_mm512_castsi512_ps(  // -gv: the sign bit flipped
            _mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(int32_t(0x80000000u)))));
        const __m512 s = overlap::round_bf16x16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + r * inter + i),
                            _mm512_cvtepi32_epi16(overlap::bf16_bits_x16(_mm512_mul_ps(s, overlap::widen_bf16x16(u + i)))));
      }
#endif
      for (; i < inter; ++i) {
        const float gv = float(g[i]);
        const float s = round_bf16(gv / (1.f + overlap::fixed_exp(-gv)));
        op[r * inter + i] = to_bf16(s * float(u[i]));
      }
    }
  });
  return out;
}

// Rotary embedding in place on the q and k heads of a fused qkv row (HF rotate_half layout):
// x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)) for heads 0..rot_heads-1 of each row.
// qkv [T, W] bf16 (heads of head_dim from column 0), cos/sin [T, head_dim] bf16.
void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t rot_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16 && qkv.is_contiguous() && cos.is_contiguous() &&
              sin.is_contiguous() && cos.scalar_type() == torch::kBFloat16);
  const int64_t t = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  auto xp = reinterpret_cast<bf16*>(qkv.data_ptr());
  auto cp = reinterpret_cast<const bf16*>(cos.data_ptr());
  auto sp = reinterpret_cast<const bf16*>(sin.data_ptr());
  overlap::parallel_for(t, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> x(head_dim);
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* c = cp + r * head_dim;
      const bf16* s = sp + r * head_dim;
      for (int64_t h = 0; h < rot_heads; ++h) {
        bf16* v = xp + r * width + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) x[d] = float(v[d]);
        for (int64_t d = 0; d < head_dim; ++d) {
          const float rot = d < half ? -x[d + half] : x[d - half];
          v[d] = to_bf16(round_bf16(x[d] * float(c[d])) + round_bf16(rot * float(s[d])));
        }
      }
    }
  });
}

namespace {

// torch.argmax's answer for one row: the first index of the largest value, and a NaN counts
// as larger than any number (the first NaN wins). Scalar: the reference, and the rare row
// holding a NaN.
int64_t argmax_row_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// 16 lanes each keep their first maximum (a strict > never replaces an equal value); the
// lanes' winners then meet with ties to the smaller index, and the tail (indices past every
// lane's) replaces only on a strict >. torch's own argmax here runs one element at a time:
// 84 us for a 49,152-token row, 0.34 ms for a 9-row tree verify.
int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 best = _mm512_loadu_ps(x);
    __m512i best_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i at = best_at;
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, greater, v);
      best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    }
    if (nan) return argmax_row_scalar(x, n);
    alignas(64) float value[16];
    alignas(64) int32_t index[16];
    _mm512_store_ps(value, best);
    _mm512_store_si512(index, best_at);
    float m = value[0];
    int64_t m_at = index[0];
    for (int l = 1; l < 16; ++l)
      if (value[l] > m || (value[l] == m && index[l] < m_at)) { m = value[l]; m_at = index[l]; }
    for (; i < n; ++i) {
      if (x[i] != x[i]) return i;
      if (x[i] > m) { m = x[i]; m_at = i; }
    }
    return m_at;
  }
#endif
  return argmax_row_scalar(x, n);
}

}  // namespace

// x [R, V] f32 → [R] i64, torch.argmax(x, -1) exactly (first maximum; NaN largest).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) > 0,
              "argmax_rows: f32 [R, V] with V > 0");
  x = x.contiguous();
  const int64_t r = x.size(0), n = x.size(1);
  auto out = torch::empty({r}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  overlap::parallel_for(r, 2, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) op[i] = argmax_row(xp + i * n, n);
  });
  return out;
}

// sub [R, N] f32 (the scores of tokens ids[0..N), ids ascending) → [R, V] f32 with -inf at
// every other token, on the calling thread: a vectorised fill, then the N scores. As torch
// ops (full, then index_put_) it cost ~0.15 ms a head pass for V = 49,152: two parallel
// regions of a few microseconds' work, each waking the sleeping OpenMP team (~65 us).
torch::Tensor spread_columns(torch::Tensor sub, torch::Tensor ids, int64_t vocab) {
  TORCH_CHECK(sub.scalar_type() == torch::kFloat32 && sub.dim() == 2, "spread_columns: f32 [R, N]");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1 && ids.size(0) == sub.size(1),
              "spread_columns: i64 ids [N]");
  sub = sub.contiguous();
  ids = ids.contiguous();
  const int64_t r = sub.size(0), n = sub.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(id[j] >= 0 && id[j] < vocab && (j == 0 || id[j] > id[j - 1]),
                "spread_columns: ids must ascend within [0, vocab)");
  auto out = torch::empty({r, vocab}, sub.options());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < r; ++i) {
    const float* src = sub.data_ptr<float>() + i * n;
    float* dst = out.data_ptr<float>() + i * vocab;
    std::fill(dst, dst + vocab, neg_inf);
    for (int64_t j = 0; j < n; ++j) dst[id[j]] = src[j];
  }
  return out;
}

// out += x, element by element, as torch's bf16 add rounds it (the f32 sum to nearest even):
// a decoder layer's two residual adds without their dispatch (~2 us each through torch, 60 a
// pass of the target). Both [T, H] bf16, contiguous.
void add_into(torch::Tensor out, const torch::Tensor& x) {
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && x.scalar_type() == torch::kBFloat16 &&
                  out.sizes() == x.sizes() && out.is_contiguous() && x.is_contiguous(),
              "add_into: two contiguous bf16 tensors of one shape");
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  const auto* a = reinterpret_cast<const bf16*>(x.data_ptr());
  const int64_t n = out.numel();
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 sum = _mm512_add_ps(overlap::widen_bf16x16(o + i), overlap::widen_bf16x16(a + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm512_cvtepi32_epi16(overlap::bf16_bits_x16(sum)));
  }
#endif
  for (; i < n; ++i) o[i] = to_bf16(float(o[i]) + float(a[i]));
}

// rows [T, heads, head_dim] (a view whose rows are each contiguous, e.g. the K or V columns
// of the qkv projection) into their slots of a cache [slots, heads, head_dim]: index_copy_
// without its dispatch (~4 us a call through torch, twice a layer).
void store_rows(torch::Tensor cache, const torch::Tensor& slots, const torch::Tensor& rows) {
  TORCH_CHECK(cache.scalar_type() == rows.scalar_type() && cache.is_contiguous() && cache.dim() == 3 &&
                  rows.dim() == 3 && rows.size(1) == cache.size(1) && rows.size(2) == cache.size(2) &&
                  rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              "store_rows: rows [T, Hkv, D] with contiguous rows, a contiguous cache [slots, Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == rows.size(0),
              "store_rows: one i64 slot per row");
  const int64_t t = rows.size(0), capacity = cache.size(0);
  const size_t bytes = size_t(cache.size(1) * cache.size(2)) * cache.element_size();
  const size_t row_stride = size_t(rows.stride(0)) * rows.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "store_rows: a slot outside the cache");
    std::memcpy(dst + size_t(slot[i]) * bytes, src + size_t(i) * row_stride, bytes);
  }
}
