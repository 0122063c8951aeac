// Weight-only int8 linear for the drafters (MTP/EAGLE heads, the draft model) on the CPU:
// y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias[n]), q int8, one f32 scale per output.
//
// Why: at batch 1 a head pass reads ~18 MB of bf16 weights (a decoder layer, the fusion
// matmul, 8k lm_head rows) and is bound by memory bandwidth like the target's forward; a
// mtp:3 step runs three of them, ~20% of the step. int8 weights halve the bytes. Drafts only
// propose: verification runs the target in bf16 and decides every token, so the drafter's
// rounding can change which drafts are accepted, never the output (DESIGN.md §6).
//
// Layout: column blocks of NB outputs, k-major inside ([N/NB][K/KSTEP][NB][KSTEP] int8,
// zero-padded), so vector lanes run over outputs, as in linear_bf16.cpp: each output owns
// one lane of one accumulator that walks k in order, the same instruction sequence for any
// M, any row tile and any thread split (threads split column blocks only). Rows are tiled
// ROWS at a time: a 4-row pass reads each weight once.
//
// Two arithmetics, one per variant family:
// - AVX512_BF16 and AMX machines (2, 3) all have AVX512_VNNI: each row of x is quantized to
//   int16 (one f32 scale per row, |x_q| <= XQ_MAX so no int32 sum over K can overflow), the
//   int8 weights sign-extend to int16 (one instruction per 32) and vpdpwssd adds two k's
//   products per lane exactly in int32; y = float(sum) * x_scale[m] * scale[n]. A widening
//   FMA path spends two conversions per 16 weights and one FMA per weight and row: at 4 rows
//   it was compute-bound, no faster than bf16; the integer path does half the work per row.
// - AVX512F, AVX2, scalar (1, 0, -1): each weight widened to f32 (exact) and FMAed with the
//   row's f32 x[k].
#include <torch/extension.h>
#include "cpu_empty.h"
#include "pool.h"
#include "prefetch.h"
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "bf16_vec.h"
#if OVERLAP_VARIANT >= 0
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int ROWS = 4;  // rows of x per register tile

#if OVERLAP_VARIANT >= 2
// Packed [N/NB][K/2][NB][2]: a k pair of 16 outputs is 32 bytes, one int16 vector widened.
constexpr int VEC = 16, VECS = 4, KSTEP = 2;
using Acc = __m512i;
using XRow = int16_t;  // x quantized per row
inline Acc zero() { return _mm512_setzero_si512(); }
inline __m512i load_w(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i bcast_x(const XRow* x) {  // x[k], x[k+1] as one 32-bit value in every lane
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return _mm512_set1_epi32(pair);
}
inline Acc madd(Acc acc, __m512i x, __m512i w) { return _mm512_dpwssd_epi32(acc, x, w); }
inline void store(float* out, Acc a) { _mm512_storeu_ps(out, _mm512_cvtepi32_ps(a)); }
#elif OVERLAP_VARIANT == 1
constexpr int VEC = 16, VECS = 4, KSTEP = 1;  // 16 accumulators + 4 weights + x of 32 zmm
using Acc = __m512;
using XRow = float;
inline Acc zero() { return _mm512_setzero_ps(); }
inline __m512 load_w(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 bcast_x(const float* x) { return _mm512_set1_ps(*x); }
inline Acc madd(Acc acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
inline void store(float* out, Acc a) { _mm512_storeu_ps(out, a); }
#elif OVERLAP_VARIANT == 0
constexpr int VEC = 8, VECS = 2, KSTEP = 1;  // 8 accumulators + 2 weights + x of 16 ymm
using Acc = __m256;
using XRow = float;
inline Acc zero() { return _mm256_setzero_ps(); }
inline __m256 load_w(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 bcast_x(const float* x) { return _mm256_set1_ps(*x); }
inline Acc madd(Acc acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }
inline void store(float* out, Acc a) { _mm256_storeu_ps(out, a); }
#else
constexpr int VEC = 8, VECS = 2, KSTEP = 1;
struct Acc { float v[VEC]; };
using XRow = float;
inline Acc zero() { return Acc{}; }
inline const int8_t* load_w(const int8_t* p) { return p; }
inline float bcast_x(const float* x) { return *x; }
inline Acc madd(Acc acc, float x, const int8_t* w) {
  for (int i = 0; i < VEC; ++i) acc.v[i] = std::fma(x, float(w[i]), acc.v[i]);
  return acc;
}
inline void store(float* out, Acc a) { std::memcpy(out, a.v, sizeof(a.v)); }
#endif

constexpr int NB = VEC * VECS;  // outputs per column block

inline int64_t padded_k(int64_t k) { return (k + KSTEP - 1) / KSTEP * KSTEP; }

#include "tile_sums.h"

// Rows r0..r0+R of x against one column block (tile_sums.h), then the scales and the bias.
// row_scale: the f32 scale of each quantized x row (nullptr: x rows are f32 as they are).
// ahead, part, parts: the next block's prefetch, shared among the block's tiles (tile_sums.h).
template <int R, typename Out>
inline void tile(const XRow* x, const float* row_scale, int64_t kp, const int8_t* block,
                 const float* scale, const float* bias, Out* y, int64_t n, int64_t r0, int64_t c0,
                 const int8_t* ahead, int part, int parts) {
  float sums[R][NB];
  tile_sums<R>(x, kp, block, kp, r0, sums, ahead, part, parts);
  const int64_t cols = std::min<int64_t>(NB, n - c0);
  for (int r = 0; r < R; ++r) {
    const float rs = row_scale ? row_scale[r0 + r] : 1.0f;
    for (int64_t c = 0; c < cols; ++c) {
      float s = sums[r][c] * rs * scale[c0 + c];
      if (bias) s += bias[c0 + c];
      y[(r0 + r) * n + c0 + c] = Out(s);
    }
  }
}

template <typename Out>
void run(const XRow* x, const float* row_scale, int64_t kp, const int8_t* packed, const float* scale,
         const float* bias, Out* y, int64_t m, int64_t n) {
  const int64_t blocks = (n + NB - 1) / NB;
  const int parts = int((m + ROWS - 1) / ROWS);  // tiles a block takes
  overlap::parallel_for(blocks, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* block = packed + b * kp * NB;
      // The next block streams in while this one's tiles compute, each tile asking for its
      // share, as linear_bf16.cpp's rows_of_block does. A head pass runs right after the
      // target's forward has evicted its weights: without it a pass's first reads of every
      // block waited on memory.
      const int8_t* ahead = b + 1 < blocks ? block + kp * NB : nullptr;
      const int64_t c0 = b * NB;
      int64_t r = 0;
      int part = 0;
      for (; r + ROWS <= m; r += ROWS, ++part)
        tile<ROWS>(x, row_scale, kp, block, scale, bias, y, n, r, c0, ahead, part, parts);
      switch (m - r) {  // the tile sizes are template arguments: registers, not arrays
        case 3: tile<3>(x, row_scale, kp, block, scale, bias, y, n, r, c0, ahead, part, parts); break;
        case 2: tile<2>(x, row_scale, kp, block, scale, bias, y, n, r, c0, ahead, part, parts); break;
        case 1: tile<1>(x, row_scale, kp, block, scale, bias, y, n, r, c0, ahead, part, parts); break;
        default: break;
      }
    }
  });
}

// The x rows as the tiles read them, K padded to kp with zeros: f32 as they are, or (the
// integer path) quantized per row to int16 with |x_q| <= XQ_MAX, their scales in row_scale.
struct Rows {
  std::vector<XRow> x;
  std::vector<float> scale;
};

// One bf16 row widened to f32 (exact: a bf16 is an f32's high half), here rather than by
// x.to(f32): that was a dispatched op and an allocation, ~3 us, six times a head call.
void widen_row(const c10::BFloat16* row, float* out, int64_t k) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= k; j += 16) _mm512_storeu_ps(out + j, overlap::widen_bf16x16(row + j));
#endif
  for (; j < k; ++j) out[j] = float(row[j]);
}

Rows prepare_rows(torch::Tensor x, int64_t kp) {
  const int64_t m = x.size(0), k = x.size(1);
  if (x.stride(1) != 1) x = x.contiguous();
  const auto* xb = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
  Rows rows;
  rows.x.assign(m * kp, XRow(0));
#if OVERLAP_VARIANT >= 2
  // |sum_k x_q w_q| <= kp * XQ_MAX * 127 must fit an int32 (quantize_int8 clamps q to
  // +-127; pack_int8 refuses -128).
  const double xq_max = double(std::min<int64_t>(32767, ((int64_t(1) << 31) - 1) / (127 * kp)));
  rows.scale.assign(m, 0.0f);
  std::vector<float> src(static_cast<size_t>(k));  // the row being quantized, in f32
  for (int64_t i = 0; i < m; ++i) {
    widen_row(xb + i * x.stride(0), src.data(), k);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t j = 0; j < k; ++j) {
      finite &= std::isfinite(src[j]);
      amax = std::max(amax, std::fabs(src[j]));
    }
    if (!finite) {  // inf or NaN in the row: NaN sums (no int16 holds them)
      rows.scale[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (double(amax) * 1e30 < xq_max) continue;  // zeros (or denormal dust): a zero row
    rows.scale[i] = float(amax / xq_max);
    const double inv = xq_max / amax;  // double: no overflow for tiny amax
    for (int64_t j = 0; j < k; ++j) rows.x[i * kp + j] = XRow(std::nearbyint(src[j] * inv));
  }
#else
  // f32 rows as they are: widened straight into their padded places
  for (int64_t i = 0; i < m; ++i) widen_row(xb + i * x.stride(0), &rows.x[i * kp], k);
#endif
  return rows;
}

}  // namespace

// q [N, K] int8 → this variant's layout, flat: [ceil(N/NB)][padded K / KSTEP][NB][KSTEP],
// zero-padded (padding adds exact zeros).
torch::Tensor pack_int8(torch::Tensor q) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2, "pack_int8: int8 [N, K]");
  TORCH_CHECK(q.numel() == 0 || q.min().item<int8_t>() > -128,
              "pack_int8: values in [-127, 127] (the int32 sums' bound assumes it)");
  const int64_t n = q.size(0), k = q.size(1), kp = padded_k(k);
  const int64_t blocks = (n + NB - 1) / NB;
  auto w = torch::zeros({blocks * NB, kp}, q.options());
  w.narrow(0, 0, n).narrow(1, 0, k).copy_(q);
  return w.view({blocks, NB, kp / KSTEP, KSTEP}).permute({0, 2, 1, 3}).contiguous().view({-1});
}

// x [M, K] bf16; packed = pack_int8(q [N, K]); scale [N] f32 → [M, N] in bf16, or f32 when
// out_float (logits).
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t n,
                          c10::optional<torch::Tensor> bias, bool out_float) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2, "overlap linear_int8: bf16 x [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && scale.scalar_type() == torch::kFloat32 && scale.numel() == n,
              "overlap linear_int8: an int8 packed weight and f32 scales [N]");
  const int64_t m = x.size(0), kp = padded_k(x.size(1));
  TORCH_CHECK(packed.numel() == (n + NB - 1) / NB * NB * kp, "overlap linear_int8: packed weight does not fit x");
  const Rows rows = prepare_rows(x, kp);
  const float* row_scale = rows.scale.empty() ? nullptr : rows.scale.data();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto sc = scale.contiguous();
  auto wp = packed.contiguous();
  if (out_float) {
    auto y = cpu_empty({m, n}, torch::kFloat32);
    run<float>(rows.x.data(), row_scale, kp, wp.data_ptr<int8_t>(), sc.data_ptr<float>(), bp, y.data_ptr<float>(), m, n);
    return y;
  }
  auto y = cpu_empty({m, n}, x.scalar_type());
  run<bf16>(rows.x.data(), row_scale, kp, wp.data_ptr<int8_t>(), sc.data_ptr<float>(), bp,
            reinterpret_cast<bf16*>(y.data_ptr()), m, n);
  return y;
}
