// Batch-invariant bf16 linear for the CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Why not F.linear: oneDNN picks a different kernel (and so a different reduction order) for
// different row counts M, and which M reach which kernel depends on the ISA (AMX,
// AVX512_CORE_BF16, AVX512_CORE, AVX2). A token's logits then depend on how many other rows
// share its matmul, and greedy speculative decoding parts from plain decoding at near-ties.
//
// Here the weight is packed once (pack_weight) into column blocks of NB outputs, k-major
// inside a block, so vector lanes run over outputs: each output column n owns one lane of
// one accumulator, which walks k from 0 to K-1 in order (bf16 pairs with vdpbf16ps, single
// k with FMA otherwise). No horizontal sums, and the instruction sequence producing y[m, n]
// is the same for any M, any row tile and any thread split (threads split column blocks
// only). Rows are tiled ROWS at a time, so a 4-row verify reads each weight once, like a
// 1-row decode: extra rows cost compute, not bandwidth.
//
// The widening variants (AVX512F, AVX2, scalar: no bf16 dot product) turn each bf16 weight
// into f32 before its FMA, and read x as f32 rows converted once per call. AVX-512 reads the
// weights in the bf16 pairs of variant 2's layout and widens 16 of them with one instruction
// (a shift for the even k, a mask for the odd). The scalar build, with more rows than a few
// tiles, widens a column block once into a per-thread f32 copy that every row tile reads.
// Widening bf16 to f32 is exact, so the FMA sequence of each output, and its bits, are the
// same on every path.
//
// One source, compiled per ISA variant (OVERLAP_VARIANT): 3 = AMX-BF16 tiles (Sapphire
// Rapids and later: up to 16 rows x 16 outputs per tile instruction, each output accumulated
// over k in order, rows independent), 2 = AVX512_BF16, 1 = AVX512F, 0 = AVX2+FMA,
// -1 = portable scalar. Bit-identical across M within a variant, not across
// variants (a machine runs one).
//
// Variant 2 has two arithmetics over one packed layout, chosen once per process before the
// first call (set_fma_pairs; kernels/__init__.py says which machines take which): `dot`,
// vdpbf16ps on bf16 pairs of x, or `fma`, each weight pair's halves widened by one shift and
// one mask and two f32 FMAs on x as f32 rows, in k order: variant 1's arithmetic and bits.
// Why two: a 512-bit vdpbf16ps is 32 products, but Intel cores retire one every other cycle
// and two 512-bit FMAs (16 products each) every cycle (Emerald Rapids with AMX hidden, one
// core: 1.31 G dot products/s, 5.42 G FMAs/s), so there the FMAs do twice the work a cycle,
// and a verify pass of 4-16 rows is compute-bound on the dot products (the model's linears,
// cache-hot, runs/prof/lin_wide.py: 6 rows 10.4-11.8 -> 7.2-9.0 ms, 14 rows 27.5-37.8 ->
// 18.8-21.1, 64 rows 182-195 -> 115-118, 1 row alike). AMD's Zen 4/5 retire the dot products
// at the FMAs' rate.
#include <torch/extension.h>
#include "cpu_empty.h"
#include <ATen/Parallel.h>
#include "pool.h"
#include "prefetch.h"
#include "bf16_vec.h"
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstring>
#include <vector>
#if OVERLAP_VARIANT >= 0
#include <immintrin.h>
#endif
#include "amx.h"

namespace {

using bf16 = c10::BFloat16;
bool fma_pairs_on = false;  // variant 2's arithmetic: fma (true) or dot (set_fma_pairs)
#if OVERLAP_VARIANT == 3
// AMX: the packed layout of variant 2 ([N/NB][K/2][NB][2], the VNNI pairs a B tile reads),
// K padded to whole 32-element A tiles.
constexpr int VEC = 16, VECS = 4, KSTEP = 32;
#elif OVERLAP_VARIANT == 2 || OVERLAP_VARIANT == 1
// Packed [N/NB][K/2][NB][2]: a k pair of NB outputs is one 64-byte vector per 16 outputs.
// ROWS: rows of x per register tile. Six (24 accumulators + 4 weights + x of the 32 zmm
// registers), not four: a 5-6 row verify (mtp:4-5, a chain and a short lookup branch) then
// walks each block once instead of twice, and the second walk did not hide under the weight
// stream (Zen 5, 30 layers + lm_head, interleaved: 5 rows 7.8 -> 5.2 ms, 6 rows 7.0 -> 5.4,
// 1 row 5.1 -> 4.8; 7-16 rows alike; bits equal on 200 outputs). Halving the block's columns
// so 7-12 rows fit one tile per half was slower (7 rows 8.7 -> 10.3 ms): the half-lines break
// the stream.
constexpr int VEC = 16, VECS = 4, KSTEP = 2, ROWS = 6;
using Acc = __m512;
inline Acc zero() { return _mm512_setzero_ps(); }
inline __m512i load_w(const bf16* p) { return _mm512_loadu_si512(p); }
inline void store(float* out, Acc a) { _mm512_storeu_ps(out, a); }
#if OVERLAP_VARIANT == 2
// The dot arithmetic: x as bf16 pairs, one vdpbf16ps per k pair.
inline __m512i bcast_x(const bf16* x) {  // x[k], x[k+1] as one 32-bit value in every lane
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return _mm512_set1_epi32(pair);
}
inline Acc madd(Acc acc, __m512i x, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
#endif
// The fma arithmetic (variant 1's; variant 2's where set_fma_pairs chose it), x as f32 rows:
// x[k] times the pairs' low halves (a bf16 is the high half of an f32, so one shift widens
// it exactly), then x[k+1] times the high halves (one mask). One instruction per 16 weights
// where a widening of 16 single k's took two (zero-extend, shift) and a lane-crossing load.
inline __m512 even_of(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline __m512 odd_of(__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xFFFF0000u)))); }
inline const float* bcast_x(const float* x) { return x; }
inline Acc madd(Acc acc, const float* x, __m512i w) {
  acc = _mm512_fmadd_ps(_mm512_set1_ps(x[0]), even_of(w), acc);
  return _mm512_fmadd_ps(_mm512_set1_ps(x[1]), odd_of(w), acc);
}
#elif OVERLAP_VARIANT == 0
// 16 ymm registers: 6 rows x 2 accumulators + 2 weights + x. Six rows rather than four: a
// 4-row tile's 8 accumulators just cover the FMA latency (4 cycles x 2 units) and any stall
// shows, and 5-6 row verifies then take one tile (Zen 3, 30 layers + lm_head: 5 rows 24 ->
// 18 ms, 9 rows 34 -> 25 with a 1-row pass at 16).
constexpr int VEC = 8, VECS = 2, KSTEP = 1, ROWS = 6;
using Acc = __m256;
inline Acc zero() { return _mm256_setzero_ps(); }
inline __m256 load_w(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 bcast_x(const float* x) { return _mm256_set1_ps(*x); }  // x as f32 rows (run)
inline Acc madd(Acc acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }
inline void store(float* out, Acc a) { _mm256_storeu_ps(out, a); }
#else
constexpr int VEC = 8, VECS = 2, KSTEP = 1, ROWS = 4;
struct Acc { float v[VEC]; };
inline Acc zero() { return Acc{}; }
inline const bf16* load_w(const bf16* p) { return p; }
inline float bcast_x(const bf16* x) { return float(*x); }
inline Acc madd(Acc acc, float x, const bf16* w) {
  for (int i = 0; i < VEC; ++i) acc.v[i] = std::fma(x, float(w[i]), acc.v[i]);
  return acc;
}
inline void store(float* out, Acc a) { std::memcpy(out, a.v, sizeof(a.v)); }
#endif

constexpr int NB = VEC * VECS;  // outputs per column block

#if OVERLAP_VARIANT == -1
inline const float* load_w(const float* p) { return p; }
inline float bcast_x(const float* x) { return *x; }
inline Acc madd(Acc acc, float x, const float* w) {
  for (int i = 0; i < VEC; ++i) acc.v[i] = std::fma(x, w[i], acc.v[i]);
  return acc;
}
inline void widen(const bf16* w, float* out) { for (int i = 0; i < VEC; ++i) out[i] = float(w[i]); }
constexpr int WIDE_ROWS = 4;
#endif

inline int64_t padded_k(int64_t k) { return (k + KSTEP - 1) / KSTEP * KSTEP; }

#if OVERLAP_VARIANT != 3
#include "tile_sums.h"

// Rows r0..r0+R of x against column block b (tile_sums.h), then the bias and the rounding.
// X, W: bf16 (the direct path) or f32 (the widened one); the same FMAs either way. `ahead`,
// `part` of `parts`: the next packed block and this tile's share of its prefetch (tile_sums.h).
template <int R, typename X, typename W, typename Out>
inline void tile(const X* x, int64_t xk, const W* block, int64_t kp, const float* bias,
                 Out* y, int64_t n, int64_t r0, int64_t c0, const bf16* ahead, int part, int parts) {
  float sums[R][NB];
  tile_sums<R, X, W, bf16>(x, xk, block, kp, r0, sums, ahead, part, parts);
  const int64_t cols = std::min<int64_t>(NB, n - c0);
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float s = sums[r][c];
      if (bias) s += bias[c0 + c];
      y[(r0 + r) * n + c0 + c] = Out(s);
    }
}
#endif

#if OVERLAP_VARIANT == 3
// One tile row (16 f32 sums) + bias into y, vectorised: the scalar per-element epilogue cost
// as much as the tile products at K = 576. Same arithmetic as the scalar one: one f32 add of
// the bias, then c10's bf16 rounding (round to nearest even, NaN -> 0x7FC0) bit for bit.
inline __m512 with_bias(const float* c, const float* bias, __mmask16 lanes) {
  __m512 v = _mm512_load_ps(c);
  return bias ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias)) : v;
}
inline void store_row(float* y, const float* c, const float* bias, __mmask16 lanes) {
  _mm512_mask_storeu_ps(y, lanes, with_bias(c, bias, lanes));
}
inline void store_row(bf16* y, const float* c, const float* bias, __mmask16 lanes) {
  const __m512i bits = overlap::bf16_bits_x16(with_bias(c, bias, lanes));
  _mm256_mask_storeu_epi16(y, lanes, _mm512_cvtepi32_epi16(bits));
}

// tmm0-3: C (rows x 16 f32) for the block's 4 column groups; tmm4: A (rows x 32 bf16 of x);
// tmm5: B (16 k pairs x 16 outputs, VNNI pairs).
inline void configure(int rows) {
  overlap::TileConfig cfg;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }
  cfg.rows[4] = rows; cfg.colsb[4] = 64;
  cfg.rows[5] = 16; cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
}

template <typename Out>
void run(const bf16* x, int64_t xk, const bf16* packed, int64_t kp, const float* bias, Out* y,
         int64_t m, int64_t n) {
  const int64_t blocks = (n + NB - 1) / NB;
  overlap::parallel_for(blocks, 2, [&](int64_t b0, int64_t b1) {
    alignas(64) float c[16][16];
    int configured = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const bf16* block = packed + b * kp * NB;
      for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const int rows = int(std::min<int64_t>(16, m - r0));
        if (rows != configured) { configure(rows); configured = rows; }
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < kp; k += 32) {
          _tile_loadd(4, x + r0 * xk + k, xk * 2);
          const bf16* wk = block + (k / 2) * NB * 2;  // 16 k pairs x NB outputs x 2
          _tile_loadd(5, wk + 0 * 32, NB * 4); _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, wk + 1 * 32, NB * 4); _tile_dpbf16ps(1, 4, 5);
          _tile_loadd(5, wk + 2 * 32, NB * 4); _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, wk + 3 * 32, NB * 4); _tile_dpbf16ps(3, 4, 5);
        }
        for (int g = 0; g < 4; ++g) {
          switch (g) {  // tile ids are immediates
            case 0: _tile_stored(0, c, 64); break;
            case 1: _tile_stored(1, c, 64); break;
            case 2: _tile_stored(2, c, 64); break;
            default: _tile_stored(3, c, 64); break;
          }
          const int64_t c0 = b * NB + g * 16;
          if (c0 >= n) break;
          const __mmask16 lanes = n - c0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c0)) - 1);
          for (int r = 0; r < rows; ++r) store_row(y + (r0 + r) * n + c0, c[r], bias ? bias + c0 : nullptr, lanes);
        }
      }
    }
    if (configured) _tile_release();
  });
}
#else
// A per-thread f32 buffer of at least `size` floats (slot 0: x rows, 1: a widened block),
// grown when needed and kept for the thread's lifetime.
inline float* scratch(int slot, int64_t size) {
  thread_local std::vector<float> buffers[2];
  if (int64_t(buffers[slot].size()) < size) buffers[slot].resize(size);
  return buffers[slot].data();
}

// Rows r0..r0+rows (1 <= rows <= R) against one column block: the row count as a template
// argument, so a tile's accumulators are registers, not an array.
template <int R, typename X, typename W, typename Out>
inline void tile_of(int rows, const X* x, int64_t xk, const W* block, int64_t kp, const float* bias,
                    Out* y, int64_t n, int64_t r0, int64_t c0, const bf16* ahead, int part, int parts) {
  switch (rows) {
    case 6: if constexpr (R >= 6) tile<6>(x, xk, block, kp, bias, y, n, r0, c0, ahead, part, parts); break;
    case 5: if constexpr (R >= 5) tile<5>(x, xk, block, kp, bias, y, n, r0, c0, ahead, part, parts); break;
    case 4: if constexpr (R >= 4) tile<4>(x, xk, block, kp, bias, y, n, r0, c0, ahead, part, parts); break;
    case 3: tile<3>(x, xk, block, kp, bias, y, n, r0, c0, ahead, part, parts); break;
    case 2: tile<2>(x, xk, block, kp, bias, y, n, r0, c0, ahead, part, parts); break;
    default: tile<1>(x, xk, block, kp, bias, y, n, r0, c0, ahead, part, parts); break;
  }
}

// Every row of x against one column block, in as few tiles of at most R rows as will do, their
// sizes as even as they go (9 rows at R = 6: 5 + 4, not 6 + 3; at R = 4: 3 + 3 + 3, not
// 4 + 4 + 1). Why even: a tile walks the whole block whatever its rows, and with few rows its
// accumulators leave the FMA units waiting on each other's latency, so a 1-row tail tile costs
// about what a full one does. The split changes no output's FMA sequence.
//
// Every tile prefetches its share of `next`, the following packed block (tile t of T: the
// t-th T-th of it, in order; tile_sums.h): the block a tile walks is already in cache
// (prefetched while the previous block was walked), so memory streams only what the tiles
// ask ahead, and a tile that asked nothing left the bus idle under its compute (Zen 3, 30
// layers + lm_head, prefetching against none: 5-15% less at 1-12 rows). Only the last tile
// prefetched before, and each tile beyond the first added its compute to the weights'
// stream: a verify over 16-17 rows cost 1.4-1.8x one over 1; shared, it costs ~1.2x (Zen 5,
// avx512bf16, runs/prof/linear_rows.py, the model's linears alone, old / new alternately:
// 16 rows 10.8-14.4 -> 8.8-9.0 ms, 8-12 rows 8.8-11.5 -> 8.5-9.2, 1-6 rows alike; AVX-512F 16
// rows 18.6 -> 15.9, AVX2 24.2 -> 22.1).
template <int R, typename X, typename W, typename Out>
inline void rows_of_block(const X* x, int64_t xk, const W* block, int64_t kp, const float* bias,
                          Out* y, int64_t m, int64_t n, int64_t c0, const bf16* next) {
  if (m <= 0) return;  // no rows (a pass with no logits to compute): no tiles to divide them into
  const int64_t tiles = (m + R - 1) / R, base = m / tiles, longer = m % tiles;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int rows = int(base + (t < longer));
    tile_of<R>(rows, x, xk, block, kp, bias, y, n, r, c0, next, int(t), int(tiles));
    r += rows;
  }
}

template <typename Out>
void run(const bf16* x, int64_t xk, const bf16* packed, int64_t kp, const float* bias, Out* y,
         int64_t m, int64_t n) {
  const int64_t blocks = (n + NB - 1) / NB;
  const bf16* end = packed + blocks * kp * NB;  // the block after the last: none to prefetch
  auto next_of = [&](const bf16* block) { return block + kp * NB < end ? block + kp * NB : nullptr; };
  // Every row of `rows` (x as bf16 or as f32 rows: the arithmetic follows) against every packed
  // block, each widened inside the tile. Threads split column blocks only, never k: no split
  // can change a reduction order.
  auto direct = [&](const auto* rows) {
    overlap::parallel_for(blocks, 2, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const bf16* block = packed + b * kp * NB;
        rows_of_block<ROWS>(rows, xk, block, kp, bias, y, m, n, b * NB, next_of(block));
      }
    });
  };
#if OVERLAP_VARIANT == 2
  if (!fma_pairs_on) {  // the dot arithmetic, on x's bf16 pairs as they are
    direct(x);
    return;
  }
#endif
  // x once into f32 rows (exact), for both paths below: a tile then broadcasts each x[k] with
  // one load instead of a scalar bf16 -> f32 conversion per row and k, which cost more than
  // the FMAs it fed (AVX2 on a Zen 3, 30 layers + lm_head: 1 row 25-26 -> 19-20 ms, 5 rows
  // 40-43 -> 30-34, 9 rows 45-65 -> 40-44). The buffer is the thread's own and kept between
  // calls (a fresh multi-MB buffer per call costs its page faults every time).
  float* xf = scratch(0, m * xk);
  for (int64_t i = 0; i < m * xk; ++i) xf[i] = float(x[i]);
#if OVERLAP_VARIANT == -1
  // The scalar build widens a block once into f32 when several tiles will walk it: its
  // per-weight conversions cost more than the FMAs they feed. Not on AVX2, where the 6-row
  // direct tiles measured as fast or faster at every row count (Zen 3, 30 layers + lm_head,
  // widened vs direct: 12 rows 26.6 vs 20.6 ms, 32: 74 vs 64, 128: 224 vs 224, 256: 443 vs
  // 452), nor on AVX-512, where a tile widens 16 weights of a pair with one instruction
  // (Emerald Rapids, the same: 14 rows 29-30 vs 19-21 ms, 64: 148-168 vs 115-118, 256: 371-381
  // vs 372-420; runs/prof/lin_wide.py).
  if (m >= 3 * ROWS) {
    // The widened path: each block once into f32 by its thread (its own kept buffer too).
    overlap::parallel_for(blocks, 2, [&](int64_t b0, int64_t b1) {
      float* wf = scratch(1, kp * NB);
      for (int64_t b = b0; b < b1; ++b) {
        const bf16* block = packed + b * kp * NB;
        for (int64_t i = 0; i < kp * NB; i += VEC) widen(block + i, wf + i);
        rows_of_block<WIDE_ROWS>(xf, xk, wf, kp, bias, y, m, n, b * NB, next_of(block));
      }
    });
    return;
  }
#endif
  direct(xf);  // the FMA arithmetic on x's f32 rows
}
#endif

}  // namespace

// weight [N, K] bf16 → the packed layout of this variant, as a flat bf16 tensor:
// [ceil(N/NB)][padded K / KSTEP][NB][KSTEP], zero-padded (padding adds exact zeros).
torch::Tensor pack_weight(torch::Tensor weight) {
#if OVERLAP_VARIANT == 3
  TORCH_CHECK(overlap::amx_permitted(), "overlap linear_bf16: the kernel asked Linux for AMX tile state and was refused");
#endif
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.dim() == 2, "pack_weight: bf16 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), kp = padded_k(k);
  const int64_t blocks = (n + NB - 1) / NB;
  auto w = torch::zeros({blocks * NB, kp}, weight.options());
  w.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [blocks, NB, kp/PAIR, PAIR] → [blocks, kp/PAIR, NB, PAIR] (PAIR: k values per lane)
  constexpr int PAIR = KSTEP == 1 ? 1 : 2;
  return w.view({blocks, NB, kp / PAIR, PAIR}).permute({0, 2, 1, 3}).contiguous().view({-1});
}

// x [M, K] bf16, packed = pack_weight(weight [N, K]) → [M, N] in bf16, or f32 when out_float
// (the lm_head: logits keep the f32 sum instead of a bf16 rounding).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                     bool out_float) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16 && x.dim() == 2,
              "overlap linear_bf16: bf16 x [M, K] and a packed weight");
#if OVERLAP_VARIANT == 3
  TORCH_CHECK(overlap::amx_permitted(), "overlap linear_bf16: the kernel asked Linux for AMX tile state and was refused");
#endif
  const int64_t m = x.size(0), k = x.size(1), kp = padded_k(k);
  TORCH_CHECK(packed.numel() == (n + NB - 1) / NB * NB * kp, "overlap linear_bf16: packed weight does not fit x");
  if (kp != k) x = torch::constant_pad_nd(x, {0, kp - k});  // a zero pair partner adds exactly 0
  x = x.contiguous();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto xp = reinterpret_cast<const bf16*>(x.data_ptr());
  auto wp = reinterpret_cast<const bf16*>(packed.data_ptr());
  if (out_float) {
    auto y = cpu_empty({m, n}, torch::kFloat32);
    run<float>(xp, kp, wp, kp, bp, y.data_ptr<float>(), m, n);
    return y;
  }
  auto y = cpu_empty({m, n}, x.scalar_type());
  run<bf16>(xp, kp, wp, kp, bp, reinterpret_cast<bf16*>(y.data_ptr()), m, n);
  return y;
}

int variant() { return OVERLAP_VARIANT; }

// Variant 2's arithmetic for this process (the header says why two): called once, before the
// first linear, by the kernels' loader; switching later would change results mid-run.
void set_fma_pairs(bool on) {
  TORCH_CHECK(!on || OVERLAP_VARIANT == 2, "overlap linear_bf16: the fma arithmetic is variant 2's (avx512bf16) choice");
  fma_pairs_on = on;
}

bool fma_pairs() { return fma_pairs_on; }

namespace overlap {
bool prefetch_into_l2 = false;  // prefetch.h; set_prefetch_l2
}

// Where the tiles prefetch for this process (prefetch.h says why two): called once, by the
// kernels' loader, before the first linear.
void set_prefetch_l2(bool on) { overlap::prefetch_into_l2 = on; }

bool prefetch_l2() { return overlap::prefetch_into_l2; }
