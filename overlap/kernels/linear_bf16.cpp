// Batch-invariant bf16 linear for the CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Why not F.linear: oneDNN picks a different kernel (and so a different reduction order) for
// different row counts M, and which M reach which kernel depends on the ISA (AMX,
// AVX512_CORE_BF16, AVX512_CORE, AVX2). A token's logits then depend on how many other rows
// share its matmul, and greedy speculative decoding parts from plain decoding at near-ties.
//
// Here every output element is reduced by ONE accumulator vector walking k in a fixed order,
// then one fixed horizontal sum: the instruction sequence that produces y[m, n] is the same
// for any M, any tile position and any thread split (threads split n only). Rows are still
// tiled (ROWS x COLS accumulators at once) so each weight element is loaded once per tile of
// rows: a 4-row verify reads the weights as often as a 1-row decode.
//
// One source, compiled per ISA variant (OVERLAP_VARIANT): 2 = AVX512_BF16 (vdpbf16ps:
// pairs of bf16 products summed exactly, accumulated in f32), 1 = AVX512F, 0 = AVX2+FMA,
// -1 = portable scalar. The result is bit-identical across M within a variant, not across
// variants (a machine runs one).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#if OVERLAP_VARIANT >= 0
#include <immintrin.h>
#endif

namespace {

constexpr int ROWS = 4;  // rows of x per register tile
constexpr int COLS = 4;  // rows of w (outputs) per register tile

using bf16 = c10::BFloat16;

#if OVERLAP_VARIANT == 2
constexpr int STEP = 32;  // bf16 elements per accumulate step
using Acc = __m512;
inline Acc zero() { return _mm512_setzero_ps(); }
inline __m512i load(const bf16* p) { return _mm512_loadu_si512(p); }
inline Acc madd(Acc acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
inline float hsum(Acc acc) { return _mm512_reduce_add_ps(acc); }
#elif OVERLAP_VARIANT == 1
constexpr int STEP = 16;
using Acc = __m512;
inline Acc zero() { return _mm512_setzero_ps(); }
inline __m512 load(const bf16* p) {  // bf16 -> f32 is a 16-bit shift: exact
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Acc madd(Acc acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
inline float hsum(Acc acc) { return _mm512_reduce_add_ps(acc); }
#elif OVERLAP_VARIANT == 0
constexpr int STEP = 8;
using Acc = __m256;
inline Acc zero() { return _mm256_setzero_ps(); }
inline __m256 load(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Acc madd(Acc acc, __m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, acc); }
inline float hsum(Acc acc) {  // fixed tree: halves, then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int STEP = 8;
struct Acc { float v[8]; };
inline Acc zero() { return Acc{}; }
inline const bf16* load(const bf16* p) { return p; }
inline Acc madd(Acc acc, const bf16* a, const bf16* b) {
  for (int i = 0; i < 8; ++i) acc.v[i] = std::fma(float(a[i]), float(b[i]), acc.v[i]);
  return acc;
}
inline float hsum(Acc acc) {
  float s[4];
  for (int i = 0; i < 4; ++i) s[i] = acc.v[i] + acc.v[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
#endif

// The k elements past the last full STEP, in order, after the vector part.
inline float tail(const bf16* x, const bf16* w, int64_t k0, int64_t k) {
  float s = 0.f;
  for (int64_t i = k0; i < k; ++i) s = std::fma(float(x[i]), float(w[i]), s);
  return s;
}

// One tile: rows r0..r0+R of x against outputs c0..c0+C of w. R <= ROWS, C <= COLS are
// compile-time so the accumulators live in registers.
template <int R, int C, typename Out>
inline void tile(const bf16* x, const bf16* w, const float* bias, Out* y, int64_t k,
                 int64_t n, int64_t r0, int64_t c0) {
  Acc acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  const int64_t kv = k - k % STEP;
  for (int64_t i = 0; i < kv; i += STEP) {
    decltype(load(x)) wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(w + (c0 + c) * k + i);
    for (int r = 0; r < R; ++r) {
      auto xv = load(x + (r0 + r) * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = madd(acc[r][c], xv, wv[c]);
    }
  }
  // Reduce every accumulator before anything is stored: a store through y (float or bf16)
  // may alias the vector accumulators, which would force them to memory in the k loop.
  float sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = hsum(acc[r][c]);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = sums[r][c] + tail(x + (r0 + r) * k, w + (c0 + c) * k, kv, k);
      if (bias) s += bias[c0 + c];
      y[(r0 + r) * n + c0 + c] = Out(s);
    }
}

template <int C, typename Out>
inline void column_block(const bf16* x, const bf16* w, const float* bias, Out* y, int64_t m,
                         int64_t k, int64_t n, int64_t c0) {
  int64_t r = 0;
  for (; r + ROWS <= m; r += ROWS) tile<ROWS, C>(x, w, bias, y, k, n, r, c0);
  for (; r < m; ++r) tile<1, C>(x, w, bias, y, k, n, r, c0);
}

template <typename Out>
void run(const bf16* x, const bf16* w, const float* bias, Out* y, int64_t m, int64_t k,
         int64_t n) {
  const int64_t blocks = (n + COLS - 1) / COLS;
  // Threads split the outputs only, never k: a thread count or split change cannot change
  // any element's reduction order. Grain: ~64 KiB of weights per task.
  const int64_t grain = std::max<int64_t>(1, (32768 / std::max<int64_t>(k, 1)) / COLS);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * COLS;
      if (c0 + COLS <= n) {
        column_block<COLS>(x, w, bias, y, m, k, n, c0);
      } else {
        for (int64_t c = c0; c < n; ++c) column_block<1>(x, w, bias, y, m, k, n, c);
      }
    }
  });
}

}  // namespace

// x [M, K] bf16, weight [N, K] bf16, bias [N] or None → [M, N] in bf16, or f32 when
// out_float (the lm_head: logits keep the f32 sum instead of a bf16 rounding).
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                     bool out_float) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && weight.dtype() == torch::kBFloat16,
              "overlap linear_bf16: x and weight must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "overlap linear_bf16: shapes ", x.sizes(), " and ", weight.sizes());
  x = x.contiguous();
  TORCH_CHECK(weight.is_contiguous(), "overlap linear_bf16: weight must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto xp = reinterpret_cast<const bf16*>(x.data_ptr());
  auto wp = reinterpret_cast<const bf16*>(weight.data_ptr());
  if (out_float) {
    auto y = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
    run<float>(xp, wp, bp, y.data_ptr<float>(), m, k, n);
    return y;
  }
  auto y = torch::empty({m, n}, x.options());
  run<bf16>(xp, wp, bp, reinterpret_cast<bf16*>(y.data_ptr()), m, k, n);
  return y;
}

int variant() { return OVERLAP_VARIANT; }
