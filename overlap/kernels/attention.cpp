// Paged attention for the CPU, batch-invariant by construction.
//
// Every query row (sequence b, new token i, head h) is computed by the same arithmetic
// whatever else is in the step: scores over its visible keys (a fixed-width partial-sum dot
// product, then a fixed-order lane sum), a two-pass softmax in f32, and the weighted sum of
// values in ascending key order. So a token's attention output is the same bits in a
// prefill, a verify pass over k+1 rows, a tree verify, a decode step or any batch.
// No context gather, no mask tensor, no f64: keys and values are read in place from the
// paged pool through the page table.
//
// On AMX machines (variant 3) with bf16 caches and head_dim 32-256 a power of two, a score is
// instead the tile instruction's dot product (tdpbf16ps, see tile_scores): 16 queries x 16
// keys per instruction, each score summed on its own whatever sits beside it in the tile, so
// the row invariance above holds. How the instruction sums inside is its own (no sequence of
// f32 operations reproduces it), so on this variant the reference loops also take each
// score from it, one query and one key at a time. Where pages hold a multiple of 16 tokens,
// the values of a row's keys below value_split(its position) are summed on tiles as well
// (tile_values: bf16 weights, 16 keys an instruction, read from the pool's pair copy of the
// value cache), the rest in f32 as below; the split depends on the row's position alone.
//
// Two implementations of that one arithmetic, giving the same bits:
// - attend_reference: plain loops, any ISA, any head_dim (the generic variant, f16 on AVX2);
//   a tile score from tile_dot where the call scores on tiles.
// - attend_vector (variants 0-3, head_dim 16-256, a power of two): the same operations in the
//   same order per score and per output element, on 16-lane vectors (one zmm, or two ymm on
//   AVX2), arranged for the vector unit: 16 keys' scores are lane-summed together (reduce16:
//   a transpose-and-add tree doing each key's pairwise lane sum, instead of 16 separate
//   horizontal sums; tile_scores where the call scores on tiles), the softmax runs on whole
//   rows, and values are accumulated for a tile of query rows from registers. Scores of keys a row
//   may not see are computed with the others and then given weight exactly 0: adding +0 to a
//   sum that is never -0 leaves it unchanged, so no per-key visibility test in the hot loops.
#include <torch/extension.h>
#include "cpu_empty.h"
#include <ATen/Parallel.h>
#include "pool.h"
#include "fixed_exp.h"
#include "bf16_vec.h"
#include "amx.h"
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <cstring>
#include <vector>
#if OVERLAP_VARIANT >= 0
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 16;   // partial sums per dot product
constexpr int MAX_DIM = 256;

template <typename T>
struct Inputs {
  const T *q, *kc, *vc;  // q [T, H, D]; caches [slots, Hkv, D]
  T* out;                // [T, H, D]
  const int32_t *q_start, *q_len, *kv_len, *table;
  int64_t max_pages, page_size;
  const bool* tree;  // [T, tree_cols] or null (causal)
  int64_t tree_cols, heads, kv_heads, dim;
  float scale;
  // The value cache's copy in key pairs ([pages][Hkv][page_size / 2][D][2], see KVPool), or
  // null: tile_values then pairs the keys it needs itself.
  const uint16_t* vpairs = nullptr;
  int64_t group() const { return heads / kv_heads; }
};

// One task: a block of query rows i0 .. i0+rows-1 of sequence b, against kv head kvh.
struct Block {
  int64_t b = 0, kvh = 0, i0 = 0, rows = 0, prefix = 0, span = 0;
  int64_t row0 = 0;               // the block's first row in the flat q
  const bool* tree = nullptr;     // the sequence's mask rows, null when causal
  int64_t tree_cols = 0;
  std::vector<int64_t> end;       // per row: it sees no key at or after end[ii]
  std::vector<int64_t> slot;      // per key j < span: its slot in the pool
  // Row ii sees keys 0..prefix+i causally, or the prefix plus the tree nodes its mask row
  // allows: its own visibility, whatever else is in the block.
  bool visible(int64_t ii, int64_t j) const {
    if (j >= end[ii]) return false;
    return !tree || j < prefix || tree[(row0 + ii) * tree_cols + (j - prefix)];
  }
};

template <typename T>
void plan_block(const Inputs<T>& in, int64_t b, int64_t kvh, int64_t i0, int64_t rows_per_task, Block& blk) {
  blk.b = b;
  blk.kvh = kvh;
  blk.i0 = i0;
  blk.rows = std::min<int64_t>(rows_per_task, in.q_len[b] - i0);
  blk.prefix = in.kv_len[b] - in.q_len[b];
  blk.row0 = in.q_start[b] + i0;
  blk.tree = in.tree;
  blk.tree_cols = in.tree_cols;
  blk.end.resize(blk.rows);
  for (int64_t ii = 0; ii < blk.rows; ++ii) blk.end[ii] = in.tree ? in.kv_len[b] : blk.prefix + i0 + ii + 1;
  blk.span = std::max(blk.end[0], blk.end[blk.rows - 1]);
  // Slots by walking the page table (no division per key).
  const int32_t* pages = in.table + b * in.max_pages;
  blk.slot.resize(blk.span);
  for (int64_t j = 0, p = 0, off = 0; j < blk.span; ++j) {
    blk.slot[j] = int64_t(pages[p]) * in.page_size + off;
    if (++off == in.page_size) off = 0, ++p;
  }
}

template <typename T>
inline const T* key(const Inputs<T>& in, const Block& blk, int64_t j) {
  return in.kc + (blk.slot[j] * in.kv_heads + blk.kvh) * in.dim;
}
template <typename T>
inline const T* value(const Inputs<T>& in, const Block& blk, int64_t j) {
  return in.vc + (blk.slot[j] * in.kv_heads + blk.kvh) * in.dim;
}
// Query n = ii * group + g of the block (row ii, head g of the kv head's group).
template <typename T>
inline const T* query(const Inputs<T>& in, const Block& blk, int64_t n) {
  const int64_t ii = n / in.group(), g = n % in.group();
  return in.q + ((blk.row0 + ii) * in.heads + blk.kvh * in.group() + g) * in.dim;
}
template <typename T>
inline T* output(const Inputs<T>& in, const Block& blk, int64_t n) {
  const int64_t ii = n / in.group(), g = n % in.group();
  return in.out + ((blk.row0 + ii) * in.heads + blk.kvh * in.group() + g) * in.dim;
}

// Per-thread buffers, reused across tasks.
struct Scratch {
  std::vector<float> qf, kf, vf, scores, acc, max_s, total;
  std::vector<uint16_t> qb;  // tile_scores: the block's queries as bf16 bits, 16-row tiles
  std::vector<uint16_t> vb, pb;  // tile_values: values paired per call (no vpairs), weights as A tiles
  std::vector<int64_t> first;    // tile_values: per query, the first key left to the vector loops
  std::vector<const uint16_t*> chunks;  // tile_values: each 16-key chunk's value pairs
};

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}

// q · k over dim elements: LANES independent partial sums, then a fixed pairwise tree.
inline float dot(const float* q, const float* k, int64_t dim) {
  float part[LANES] = {0};
  int64_t d = 0;
  for (; d + LANES <= dim; d += LANES)
    for (int l = 0; l < LANES; ++l) part[l] = std::fma(q[d + l], k[d + l], part[l]);
  for (int l = 0; d < dim; ++d, ++l) part[l] = std::fma(q[d], k[d], part[l]);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

#if OVERLAP_VARIANT == 3
// Whether this call's scores come from AMX tiles: bf16 and a head_dim with a vector path (32-256,
// a power of two: whole 32-element tile rows). Other head_dims run the reference loops, which
// keep dot(): a tile configured per score would make them far slower.
template <typename T>
constexpr bool tile_scored(int64_t dim) {
  return std::is_same_v<T, c10::BFloat16> && (dim == 32 || dim == 64 || dim == 128 || dim == 256);
}

// The definition of a tile score: q · k by tdpbf16ps over dim / 32 chunks of 32 elements,
// summed from zero, in a 1 x 1 tile (tmm0: the sum; tmm1: the query's chunk; tmm2: the key's
// chunk as 16 rows of one bf16 pair each, read straight from the key).
inline float tile_dot(const c10::BFloat16* q, const c10::BFloat16* k, int64_t dim) {
  overlap::TileConfig cfg;
  cfg.rows[0] = 1, cfg.colsb[0] = 4;
  cfg.rows[1] = 1, cfg.colsb[1] = 64;
  cfg.rows[2] = 16, cfg.colsb[2] = 4;
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  for (int64_t c = 0; c < dim / 32; ++c) {
    _tile_loadd(1, q + 32 * c, 64);
    _tile_loadd(2, k + 32 * c, 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  float sum;
  _tile_stored(0, &sum, 4);
  _tile_release();
  return sum;
}
#else
template <typename T>
constexpr bool tile_scored(int64_t) { return false; }
#endif

// Values on tiles (variant 3, tile-scored calls, pages of a multiple of 16 keys): a row at
// position pos sums the values of keys [0, value_split(pos)) by tdpbf16ps, 16 keys (one
// page's worth of pairs) an instruction, its weights rounded to bf16, and the keys after them
// one by one in f32 as elsewhere. The split depends on the row's own position only, so the
// same keys go through the same instructions in a decode step, a verify pass and a prefill.
// In a tree, those keys must be keys the row sees at their own positions: the cached prefix
// and the run of its ancestors at the tree's first columns; paged_attention refuses a tree
// with a row whose other visible nodes number more than VALUE_MARGIN (a 16-deep branch).
constexpr int64_t VALUE_CHUNK = 16, VALUE_MARGIN = 16;
inline int64_t value_split(int64_t pos) {
  return std::max<int64_t>(0, (pos + 1 - VALUE_MARGIN) / VALUE_CHUNK * VALUE_CHUNK);
}
template <typename T>
inline bool tile_valued(const Inputs<T>& in) {
  return tile_scored<T>(in.dim) && in.page_size % VALUE_CHUNK == 0;
}

// The position of block row ii's own token: the last key it sees causally, or in a tree the
// prefix plus the new tokens its mask row shows (its ancestors and itself) less one.
inline int64_t row_position(const Block& blk, int64_t ii) {
  if (!blk.tree) return blk.end[ii] - 1;
  int64_t seen = 0;
  for (int64_t j = blk.prefix; j < blk.span; ++j) seen += blk.visible(ii, j);
  return blk.prefix + seen - 1;
}

#if OVERLAP_VARIANT == 3

// The weights' sum of a row's tile part: the bf16-rounded weights of keys below `first`, 16
// lanes (lane l: keys l, l + 16, ...) summed in key order, then a fixed pairwise lane tree.
inline float tile_weights_sum(const float* lanes_in) {
  float part[16];
  std::memcpy(part, lanes_in, sizeof(part));
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// The definition of a row's tile part: per value dim d, the chunks of 16 keys below `first`,
// accumulated from zero in a 1 x 1 tile, as tile_values computes them 16 queries x 16 dims
// at a time; and their weights' sum (tile_weights_sum). p: the row's f32 weights (rounded here).
inline void reference_tile_values(const Inputs<c10::BFloat16>& in, const Block& blk, const float* p, int64_t first,
                                  float* acc, float& total) {
  overlap::TileConfig cfg;
  cfg.rows[0] = 1, cfg.colsb[0] = 4;
  cfg.rows[1] = 1, cfg.colsb[1] = 32;
  cfg.rows[2] = 8, cfg.colsb[2] = 4;
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t weights[16], pairs[16];
  for (int64_t d = 0; d < in.dim; ++d) {
    _tile_zero(0);
    for (int64_t c = 0; c < first; c += VALUE_CHUNK) {
      for (int64_t j = 0; j < 16; ++j) {
        weights[j] = c10::BFloat16(p[c + j]).x;
        pairs[j] = value(in, blk, c + j)[d].x;
      }
      _tile_loadd(1, weights, 32);
      _tile_loadd(2, pairs, 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, acc + d, 4);
  }
  _tile_release();
  float lanes[16] = {0};
  for (int64_t c = 0; c < first; c += VALUE_CHUNK)
    for (int l = 0; l < 16; ++l) lanes[l] += float(c10::BFloat16(p[c + l]));
  total = tile_weights_sum(lanes);
}
#endif

// Where a row's value sum leaves the tiles for the f32 loops (0: no tile part).
template <typename T>
inline int64_t first_vector_key(const Inputs<T>& in, const Block& blk, int64_t ii) {
#if OVERLAP_VARIANT == 3
  if (tile_valued(in)) return value_split(row_position(blk, ii));
#endif
  (void)in, (void)blk, (void)ii;
  return 0;
}

// Each of the block's nq queries' first vector key into s.first (padded with 0 to whole
// 16-query tiles), once per block for the score and value passes; → the least of them.
template <typename T>
int64_t value_firsts(const Inputs<T>& in, const Block& blk, Scratch& s, int64_t nq) {
  const int64_t group = in.group();
  s.first.assign((nq + 15) / 16 * 16, 0);
  int64_t least = blk.span;
  for (int64_t ii = 0; ii < blk.rows; ++ii) {
    const int64_t first = first_vector_key(in, blk, ii);
    for (int64_t g = 0; g < group; ++g) s.first[ii * group + g] = first;
    least = std::min(least, first);
  }
  return least;
}

// Query n's score against key j before the scale: the tile's dot product where this variant
// scores on tiles, else dot() of the widened rows qf and kf.
template <typename T>
inline float reference_score(const Inputs<T>& in, const Block& blk, int64_t n, int64_t j, const float* qf, const float* kf) {
#if OVERLAP_VARIANT == 3
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (tile_scored<T>(in.dim)) return tile_dot(query(in, blk, n), key(in, blk, j), in.dim);
#endif
  (void)blk, (void)n, (void)j;
  return dot(qf, kf, in.dim);
}

// The definition of the arithmetic, in plain loops (the AVX2 and generic variants, and any
// head_dim): scores key by key (tile_dot's where the call scores on tiles), softmax over the
// visible keys, values in key order.
template <typename T>
void attend_reference(const Inputs<T>& in, const Block& blk, Scratch& s) {
  const int64_t group = in.group(), dim = in.dim, nq = blk.rows * group, span = blk.span;
  s.qf.resize(nq * dim);
  s.kf.resize(dim);
  s.vf.resize(dim);
  for (int64_t n = 0; n < nq; ++n) to_float(query(in, blk, n), s.qf.data() + n * dim, dim);
  // 1. scores of every visible key, each key loaded once for the block.
  s.scores.assign(nq * span, 0.f);
  for (int64_t j = 0; j < span; ++j) {
    to_float(key(in, blk, j), s.kf.data(), dim);
    for (int64_t ii = 0; ii < blk.rows; ++ii) {
      if (!blk.visible(ii, j)) continue;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t n = ii * group + g;
        s.scores[n * span + j] = reference_score(in, blk, n, j, s.qf.data() + n * dim, s.kf.data()) * in.scale;
      }
    }
  }
  // 2. per row and head: the max over its visible keys, then exp of each.
  s.max_s.assign(nq, -std::numeric_limits<float>::infinity());
  for (int64_t ii = 0; ii < blk.rows; ++ii)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t n = ii * group + g;
      float* sc = s.scores.data() + n * span;
      float& m = s.max_s[n];
      if (!blk.tree) {  // causal: the row sees keys 0 .. end - 1, a plain loop
        const int64_t end = blk.end[ii];
        for (int64_t j = 0; j < end; ++j) m = std::max(m, sc[j]);
        for (int64_t j = 0; j < end; ++j) sc[j] = overlap::fixed_exp(sc[j] - m);
        continue;
      }
      for (int64_t j = 0; j < span; ++j)
        if (blk.visible(ii, j)) m = std::max(m, sc[j]);
      for (int64_t j = 0; j < span; ++j)
        if (blk.visible(ii, j)) sc[j] = overlap::fixed_exp(sc[j] - m);
    }
  // 3. per row and head: the weighted values and the weights' sum in key order, from the
  //    row's first vector key (the keys below it summed on tiles first, where the call does),
  //    each value loaded once for the block.
  s.acc.assign(nq * dim, 0.f);
  s.total.assign(nq, 0.f);
  std::vector<int64_t> first(blk.rows);
  for (int64_t ii = 0; ii < blk.rows; ++ii) {
    first[ii] = first_vector_key(in, blk, ii);
#if OVERLAP_VARIANT == 3
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      for (int64_t g = 0; first[ii] > 0 && g < group; ++g) {
        const int64_t n = ii * group + g;
        reference_tile_values(in, blk, s.scores.data() + n * span, first[ii], s.acc.data() + n * dim, s.total[n]);
      }
#endif
  }
  for (int64_t j = 0; j < span; ++j) {
    to_float(value(in, blk, j), s.vf.data(), dim);
    for (int64_t ii = 0; ii < blk.rows; ++ii) {
      if (j < first[ii] || !blk.visible(ii, j)) continue;
      for (int64_t g = 0; g < group; ++g) {
        const float p = s.scores[(ii * group + g) * span + j];
        s.total[ii * group + g] += p;
        float* a = s.acc.data() + (ii * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) a[d] = std::fma(p, s.vf[d], a[d]);
      }
    }
  }
  for (int64_t n = 0; n < nq; ++n) {
    T* o = output(in, blk, n);
    const float inv = 1.f / s.total[n];
    const float* a = s.acc.data() + n * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = T(a[d] * inv);
  }
}

#if OVERLAP_VARIANT >= 0

// The vector path works on 16-lane f32 vectors (V16): one zmm register on the AVX-512
// variants, two ymm registers (lanes 0-7, 8-15) on AVX2. Each ISA below defines V16, its
// arithmetic (add, mul: never fused, as the reference loops), the widening loads, exp, the
// row max and reduce16; the attention code after them is one source for both.
#if OVERLAP_VARIANT >= 1

using V16 = __m512;
inline V16 vzero() { return _mm512_setzero_ps(); }
inline V16 vset1(float x) { return _mm512_set1_ps(x); }
inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 vfma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline V16 vexp(V16 x) { return overlap::fixed_exp16(x); }
inline void vstore(float* p, V16 v) { _mm512_storeu_ps(p, v); }

template <typename T>
constexpr bool has_load16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// 16 consecutive elements widened to f32 (exact for all three types).
inline V16 load16(const float* p) { return _mm512_loadu_ps(p); }
inline V16 load16(const c10::BFloat16* p) { return overlap::widen_bf16x16(p); }
inline V16 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A key's 16 partial sums as reduce16 takes them: as they are on AVX-512.
using Folded = __m512;
inline Folded fold(V16 part) { return part; }

// P[k] holds key k's 16 lane partial sums; returns the 16 keys' dot products in key order,
// each summed exactly as dot() does: lane l += lane l+8 (l < 8), then l+4, l+2, l+1. Each
// level adds two half-vectors of two keys at once, so 16 keys cost 15 adds and 30 shuffles
// instead of 16 separate horizontal sums.
inline V16 reduce16(const Folded* P) {
  __m512 X[8], Y[4], Z[2];
  for (int m = 0; m < 8; ++m)  // X[m]: keys 2m, 2m+1, 8 partials each (l + l+8)
    X[m] = _mm512_add_ps(_mm512_shuffle_f32x4(P[2 * m], P[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(P[2 * m], P[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)  // Y[m]: 128-bit lane k holds key 4m+k's 4 partials (l + l+4)
    Y[m] = _mm512_add_ps(_mm512_shuffle_f32x4(X[2 * m], X[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(X[2 * m], X[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)  // Z[m]: lane k holds keys 8m+k, 8m+4+k, 2 partials each (l + l+2)
    Z[m] = _mm512_add_ps(_mm512_shuffle_ps(Y[2 * m], Y[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(Y[2 * m], Y[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Element e of 128-bit lane k: key 4e + k (l + l+1).
  const __m512 W = _mm512_add_ps(_mm512_shuffle_ps(Z[0], Z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(Z[0], Z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, W);
}

// The max of sc [0, n): in 16 lanes, then across them. The same value as a scalar running
// max (max is exact; only the sign of a zero max could differ, and s - (+0) == s - (-0) but
// for s = 0, whose exp is 1 either way). max_ps(x, acc) keeps acc when x is NaN, as std::max
// does.
inline float max_of(const float* sc, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = lowest;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(_mm512_loadu_ps(sc + j), mv);
  if (j < n) mv = _mm512_max_ps(_mm512_mask_loadu_ps(lowest, __mmask16((1u << (n - j)) - 1), sc + j), mv);
  return _mm512_reduce_max_ps(mv);
}

// Query rows per register tile of the value pass (32 zmm): NT * C accumulators + C values.
template <int C>
constexpr int tile_rows() { return C <= 4 ? 6 : (C == 8 ? 3 : 1); }

#else  // AVX2: a V16 is two ymm registers

struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vexp(V16 x) { return {overlap::fixed_exp8(x.lo), overlap::fixed_exp8(x.hi)}; }
inline void vstore(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}

// f16 stays on the reference loops here (F16C is not among this variant's flags; the
// engine runs bf16 or f32).
template <typename T>
constexpr bool has_load16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

inline __m256 widen_bf16x8(const c10::BFloat16* p) {  // exact: a bf16 is an f32's high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load16(const c10::BFloat16* p) { return {widen_bf16x8(p), widen_bf16x8(p + 8)}; }

// Eight keys' 8 partial sums (Q[k] = lanes l + l+8 of key k, dot()'s first level) → their
// dot products in key order: l + l+4 across 128-bit halves, then l + l+2 and l + l+1 by
// in-lane shuffles, two keys per add, as reduce16 does on AVX-512.
inline __m256 reduce8(const __m256* Q) {
  __m256 X[4], Y[2];
  for (int m = 0; m < 4; ++m)  // X[m]: half 0 key 2m, half 1 key 2m+1, 4 partials each
    X[m] = _mm256_add_ps(_mm256_permute2f128_ps(Q[2 * m], Q[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(Q[2 * m], Q[2 * m + 1], 0x31));
  for (int m = 0; m < 2; ++m)  // Y[m]: half i holds keys 4m+i, 4m+2+i, 2 partials each
    Y[m] = _mm256_add_ps(_mm256_shuffle_ps(X[2 * m], X[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(X[2 * m], X[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Element e of half i: key 2e + i.
  const __m256 Z = _mm256_add_ps(_mm256_shuffle_ps(Y[0], Y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(Y[0], Y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(Z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A key's 16 partial sums folded to 8 by dot()'s first level (l + l+8), as soon as they are
// complete: 16 keys then hold 16 ymm registers instead of 32.
using Folded = __m256;
inline Folded fold(V16 part) { return _mm256_add_ps(part.lo, part.hi); }

inline V16 reduce16(const Folded* P) { return {reduce8(P), reduce8(P + 8)}; }

// The max of sc [0, n): 8 lanes, across them, then the tail, all with std::max's rule
// (max_ps(x, acc) keeps acc when x is NaN); the value of a scalar running max (see above).
inline float max_of(const float* sc, int64_t n) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sc + j), mv);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = lanes[0];
  for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
  for (; j < n; ++j) m = std::max(m, sc[j]);
  return m;
}

// Query rows per register tile of the value pass (16 ymm): 2 * NT * C accumulators + values.
template <int C>
constexpr int tile_rows() { return C == 1 ? 6 : (C == 2 ? 2 : 1); }

#endif  // the ISA's V16

// Ask for a key or value row [dim] ahead of its use (HINT: _MM_HINT_T0 into L1, T1 into L2).
// The pool is paged: the hardware prefetcher sees a new stream at every page, so a decode
// step over many sequences otherwise waits on memory at each one.
template <int HINT, typename T>
inline void prefetch_row(const T* p, int64_t dim) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < dim * int64_t(sizeof(T)); b += 64) _mm_prefetch(c + b, _mm_hint(HINT));
}

// Scores of one query against 16 keys kf [16][C*16] f32: dot() per key, times scale.
template <int C>
inline void score16(const float* q, const float* kf, float scale, float* out) {
  V16 qv[C];
  Folded P[16];
  for (int c = 0; c < C; ++c) qv[c] = load16(q + 16 * c);
  for (int k = 0; k < 16; ++k) {
    V16 part = vzero();  // dot()'s zero start (keeps the sign of a zero sum)
    for (int c = 0; c < C; ++c) part = vfma(qv[c], load16(kf + (k * C + c) * 16), part);
    P[k] = fold(part);
  }
  vstore(out, vmul(reduce16(P), vset1(scale)));
}

// exp(s - m) over sc [0, n rounded up to 16) in place: the last vector's extra lanes get
// values too, which the caller overwrites.
inline void exp_shifted(float* sc, int64_t n, float m) {
  const V16 mv = vset1(m);
  for (int64_t j = 0; j < n; j += 16) vstore(sc + j, vexp(vsub(load16(sc + j), mv)));
}

// Softmax weights of a query of block row ii over its scores sc [stride] in place: the max
// over its visible keys, exp(s - max) for those, exactly 0 for every other key up to stride.
inline void softmax_row(const Block& blk, int64_t ii, float* sc, int64_t stride) {
  if (!blk.tree) {  // causal: keys 0 .. end-1, no per-key test
    const int64_t end = blk.end[ii];
    exp_shifted(sc, end, max_of(sc, end));
    std::fill(sc + end, sc + stride, 0.f);
    return;
  }
  // Tree: the whole cached prefix, then the new tokens the row's mask allows.
  float m = max_of(sc, blk.prefix);
  for (int64_t j = blk.prefix; j < blk.span; ++j)
    if (blk.visible(ii, j)) m = std::max(m, sc[j]);
  exp_shifted(sc, blk.span, m);
  for (int64_t j = blk.prefix; j < blk.span; ++j)
    if (!blk.visible(ii, j)) sc[j] = 0.f;
  std::fill(sc + blk.span, sc + stride, 0.f);
}

// Queries q0 .. q0+NT-1: their weighted sums of values in ascending key order from key j0,
// with the weights' sum in the same order, accumulated in registers from acc0 [NT][C*16] and
// total0 [NT] (tile_values' sums; null: from zero); then out = acc / sum.
template <typename T, int C, int NT>
void weigh_values(const Inputs<T>& in, const Block& blk, const float* scores, int64_t stride, int64_t q0, int64_t j0,
                  const float* acc0, const float* total0) {
  V16 acc[NT][C];
  float total[NT];
  for (int t = 0; t < NT; ++t) {
    total[t] = total0 ? total0[t] : 0.f;
    for (int c = 0; c < C; ++c) acc[t][c] = acc0 ? load16(acc0 + t * C * 16 + 16 * c) : vzero();
  }
  const float* p = scores + q0 * stride;
  for (int64_t j = j0; j < blk.span; ++j) {
    const T* v = value(in, blk, j);
    V16 vj[C];
    for (int c = 0; c < C; ++c) vj[c] = load16(v + 16 * c);
    for (int t = 0; t < NT; ++t) {
      const float pj = p[t * stride + j];
      total[t] += pj;
      const V16 pb = vset1(pj);
      for (int c = 0; c < C; ++c) acc[t][c] = vfma(pb, vj[c], acc[t][c]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    float a[C * 16];
    const V16 inv = vset1(1.f / total[t]);
    for (int c = 0; c < C; ++c) vstore(a + 16 * c, vmul(acc[t][c], inv));
    T* o = output(in, blk, q0 + t);
    for (int d = 0; d < C * 16; ++d) o[d] = T(a[d]);
  }
}

template <typename T, int C, int NT = tile_rows<C>()>
void weigh_values_tail(const Inputs<T>& in, const Block& blk, const float* scores, int64_t stride, int64_t q0, int64_t n,
                       int64_t j0, const float* acc0, const float* total0) {
  if constexpr (NT > 1) {
    if (n < NT) return weigh_values_tail<T, C, NT - 1>(in, blk, scores, stride, q0, n, j0, acc0, total0);
  }
  weigh_values<T, C, NT>(in, blk, scores, stride, q0, j0, acc0, total0);
}

#if OVERLAP_VARIANT == 3
// 16 x 16 transpose of 32-bit elements: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // 32-bit pairs of rows i, i+1
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit pairs: 4 x 4 blocks inside each 128-bit lane
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)  // then the 128-bit lanes, in two rounds
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Step 1 of attend_vector on tiles: the block's nq queries (bf16, in 16-row tiles, zero rows
// past nq) against 16 keys at a time, each key read once for the block and its bf16 pairs
// transposed into the B tile's layout (VNNI: row r holds every key's pair r). tmm0: 16 x 16
// sums (queries x keys), tmm1: 16 queries x 32 dims, tmm2: 32 dims x 16 keys. A sum is the
// tile_dot of its query and key wherever they sit in the tiles; then times scale.
// values_from: the least key whose value row step 3 reads (the keys below it are summed from
// the value cache's pair copy), whose rows are fetched ahead here.
template <int C>
void tile_scores(const Inputs<c10::BFloat16>& in, const Block& blk, Scratch& s, int64_t nq, int64_t stride,
                 int64_t values_from) {
  constexpr int64_t dim = C * 16, chunks = dim / 32;
  const int64_t tiles = (nq + 15) / 16, span = blk.span;
  s.qb.assign(tiles * 16 * dim, 0);
  for (int64_t n = 0; n < nq; ++n) std::memcpy(s.qb.data() + n * dim, query(in, blk, n), dim * 2);
  alignas(64) uint32_t pairs[chunks][16][16];  // per 32-dim chunk: [pair][key]
  overlap::TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  for (int64_t j0 = 0; j0 < span; j0 += 16) {
    const int64_t keys = std::min<int64_t>(16, span - j0);
    for (int64_t k = 0; k < keys; ++k) {
      if (j0 + 16 + k < span) prefetch_row<_MM_HINT_T0>(key(in, blk, j0 + 16 + k), dim);  // the next block's keys
      if (j0 + k >= values_from) prefetch_row<_MM_HINT_T1>(value(in, blk, j0 + k), dim);  // for step 3
    }
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i r[16];  // past span: zeros, whose scores softmax_row discards
      for (int64_t k = 0; k < 16; ++k)
        r[k] = k < keys ? _mm512_loadu_si512(key(in, blk, j0 + k) + 32 * c) : _mm512_setzero_si512();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(pairs[c][i], r[i]);
    }
    for (int64_t t = 0; t < tiles; ++t) {
      _tile_zero(0);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(1, s.qb.data() + t * 16 * dim + 32 * c, dim * 2);
        _tile_loadd(2, pairs[c], 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, s.scores.data() + t * 16 * stride + j0, stride * 4);
    }
  }
  _tile_release();
  const V16 scale = vset1(in.scale);
  for (int64_t n = 0; n < nq; ++n)
    for (int64_t j = 0; j < stride; j += 16) {
      float* sc = s.scores.data() + n * stride + j;
      vstore(sc, vmul(load16(sc), scale));
    }
}

// 16 keys' values from key j (two at a time) in the B tile's pair layout at out [8][dim][2].
inline void pair_values(const Inputs<c10::BFloat16>& in, const Block& blk, int64_t j, uint16_t* out) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t r = 0; r < 8; ++r) {
    const c10::BFloat16 *v0 = value(in, blk, j + 2 * r), *v1 = value(in, blk, j + 2 * r + 1);
    for (int64_t d = 0; d < in.dim; d += 16) {
      const __m512i both = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)), 1);
      _mm512_storeu_si512(out + (r * in.dim + d) * 2, _mm512_permutexvar_epi16(order, both));
    }
  }
}

// Step 3's tile part (tile_valued calls): for each query n, first[n] = value_split(its row's
// position); acc [nq][dim] and total [nq] get the sums over the keys below it, and those keys'
// f32 weights become 0 in scores, so that the vector loops after it, which start at the least
// first of their queries, add nothing for them. Per tile of up to 16 queries and 16 keys:
// tmm4 the queries' bf16 weights, tmm5-7 in turn the keys' values for 16 dims as pairs (from
// in.vpairs, or paired here), tmm0-3 the sums of up to 4 x 16 dims. A query's sums are
// stored when its own chunks end (the tile's others may go on), so each is the 1 x 1 tile sum
// of reference_tile_values; its weights' sum is tile_weights_sum's, taken on the vector unit.
// s.first: set by value_firsts.
template <int C>
void tile_values(const Inputs<c10::BFloat16>& in, const Block& blk, Scratch& s, int64_t nq, int64_t stride) {
  constexpr int64_t dim = C * 16;
  const int64_t tiles = (nq + 15) / 16;
  const int64_t most = *std::max_element(s.first.begin(), s.first.begin() + nq);
  s.acc.assign(tiles * 16 * dim, 0.f);
  s.total.assign(tiles * 16, 0.f);
  if (most == 0) return;
  // Each query's weights below its first in bf16 ([nq][most], zeros after) and their sum
  // (tile_weights_sum), then 0 in scores.
  s.pb.resize(nq * most);
  for (int64_t n = 0; n < nq; ++n) {
    uint16_t* w = s.pb.data() + n * most;
    float* sc = s.scores.data() + n * stride;
    V16 lanes = vzero();
    for (int64_t j = 0; j < s.first[n]; j += 16) {
      const __m512i bits = overlap::bf16_bits_x16(load16(sc + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), _mm512_cvtepi32_epi16(bits));
      lanes = vadd(lanes, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
      vstore(sc + j, vzero());
    }
    std::fill(w + s.first[n], w + most, 0);
    alignas(64) float part[16];
    vstore(part, lanes);
    s.total[n] = tile_weights_sum(part);
  }
  // The values of the keys below most as pairs, when the caller keeps no copy (in.vpairs).
  if (!in.vpairs) {
    s.vb.resize(most * dim);
    for (int64_t j = 0; j < most; j += VALUE_CHUNK) pair_values(in, blk, j, s.vb.data() + j * dim);
  }
  // Each chunk's [8][dim][2] pairs: walking the page table (page_size is a multiple of 16
  // keys), or the copy above.
  s.chunks.resize(most / VALUE_CHUNK);
  const int32_t* pages = in.table + blk.b * in.max_pages;
  const int64_t pairs_per_page = in.page_size / 2, per_page = in.page_size / VALUE_CHUNK;
  for (int64_t c = 0, p = 0, k = 0; c < int64_t(s.chunks.size()); ++c) {
    s.chunks[c] = in.vpairs ? in.vpairs + ((pages[p] * in.kv_heads + blk.kvh) * pairs_per_page + k * 8) * dim * 2
                            : s.vb.data() + c * VALUE_CHUNK * dim;
    if (++k == per_page) k = 0, ++p;
  }
  alignas(64) float sums[16][64];
  // Tiles of as many query rows as the tile has queries (a decode step's kv head has group
  // queries, not 16): tmm0-3 sums, tmm4 weights, tmm5-7 values in turn.
  int64_t configured = 0;
  const auto configure = [&](int64_t rows) {
    overlap::TileConfig cfg;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;
    cfg.rows[4] = rows, cfg.colsb[4] = 32;
    for (int t = 5; t < 8; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    configured = rows;
  };
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t* first = s.first.data() + t * 16;
    const int64_t rows = std::min<int64_t>(16, nq - t * 16);
    if (rows != configured) configure(rows);
    // The chunk counts where some of the tile's queries stop, ascending (a query of count 0 has
    // no tile part).
    int64_t stops[17], num_stops = 0;
    for (int q = 0; q < rows; ++q) stops[num_stops++] = first[q] / VALUE_CHUNK;
    std::sort(stops, stops + num_stops);
    num_stops = std::unique(stops, stops + num_stops) - stops;
    const int64_t chunks = stops[num_stops - 1];
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {  // 4 tiles of 16 dims a pass
      const int64_t groups = std::min<int64_t>(4, (dim - d0) / 16);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0, next = 0; c < chunks; ++c) {
        _tile_loadd(4, s.pb.data() + t * 16 * most + c * VALUE_CHUNK, most * 2);
        const uint16_t* v = s.chunks[c] + d0 * 2;
        _tile_loadd(5, v, dim * 4);
        _tile_dpbf16ps(0, 4, 5);
        if (groups > 1) {
          _tile_loadd(6, v + 32, dim * 4);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (groups > 2) {
          _tile_loadd(7, v + 64, dim * 4);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (groups > 3) {
          _tile_loadd(5, v + 96, dim * 4);
          _tile_dpbf16ps(3, 4, 5);
        }
        // The queries whose chunks end here take their sums now.
        while (next < num_stops && stops[next] < c + 1) ++next;
        if (next == num_stops || stops[next] != c + 1) continue;
        _tile_stored(0, sums[0], 256);
        if (groups > 1) _tile_stored(1, sums[0] + 16, 256);
        if (groups > 2) _tile_stored(2, sums[0] + 32, 256);
        if (groups > 3) _tile_stored(3, sums[0] + 48, 256);
        for (int q = 0; q < rows; ++q)
          if (first[q] == (c + 1) * VALUE_CHUNK) std::memcpy(s.acc.data() + (t * 16 + q) * dim + d0, sums[q], groups * 64);
      }
    }
  }
  _tile_release();
}
#endif

// Step 1 on 16-lane vectors: each query against 16 keys at a time (score16), each key widened
// once for the block (past span: zeros, whose scores softmax_row discards).
template <typename T, int C>
void vector_scores(const Inputs<T>& in, const Block& blk, Scratch& s, int64_t nq, int64_t stride) {
  constexpr int64_t dim = C * 16;
  const int64_t span = blk.span;
  s.qf.resize(nq * dim);
  s.kf.resize(16 * dim);
  for (int64_t n = 0; n < nq; ++n)
    for (int c = 0; c < C; ++c) vstore(s.qf.data() + n * dim + 16 * c, load16(query(in, blk, n) + 16 * c));
  for (int64_t j0 = 0; j0 < span; j0 += 16) {
    const int64_t keys = std::min<int64_t>(16, span - j0);
    for (int64_t k = 0; k < keys; ++k) {
      if (j0 + 16 + k < span) prefetch_row<_MM_HINT_T0>(key(in, blk, j0 + 16 + k), dim);  // the next block's keys
      prefetch_row<_MM_HINT_T1>(value(in, blk, j0 + k), dim);  // this block's values, for step 3
      for (int c = 0; c < C; ++c) vstore(s.kf.data() + k * dim + 16 * c, load16(key(in, blk, j0 + k) + 16 * c));
    }
    std::fill(s.kf.begin() + keys * dim, s.kf.end(), 0.f);
    for (int64_t n = 0; n < nq; ++n) score16<C>(s.qf.data() + n * dim, s.kf.data(), in.scale, s.scores.data() + n * stride + j0);
  }
}

template <typename T, int C>
void attend_vector(const Inputs<T>& in, const Block& blk, Scratch& s) {
  const int64_t nq = blk.rows * in.group(), stride = (blk.span + 15) / 16 * 16;
  // 1. scores [nq][stride] (rows up to a whole tile of 16, for tile_scores' stores).
  s.scores.resize((nq + 15) / 16 * 16 * stride);
#if OVERLAP_VARIANT == 3
  const bool tiled = tile_scored<T>(C * 16) && tile_valued(in);
  if constexpr (tile_scored<T>(C * 16)) {
    // Where the value pass starts on tiles from the pair copy, the f32 loops read only the
    // value rows from the least first key of the block's queries on.
    const int64_t least = tiled ? value_firsts(in, blk, s, nq) : 0;
    tile_scores<C>(in, blk, s, nq, stride, in.vpairs ? least : 0);
  } else
#else
  constexpr bool tiled = false;
#endif
    vector_scores<T, C>(in, blk, s, nq, stride);
  // 2. softmax weights per query.
  for (int64_t n = 0; n < nq; ++n) softmax_row(blk, n / in.group(), s.scores.data() + n * stride, stride);
  // 3. values, a register tile of queries at a time (after the tile part, where there is one,
  //    from the least first key of the tile's queries).
#if OVERLAP_VARIANT == 3
  if constexpr (tile_scored<T>(C * 16))
    if (tiled) tile_values<C>(in, blk, s, nq, stride);
#endif
  constexpr int NT = tile_rows<C>();
  for (int64_t q0 = 0; q0 < nq; q0 += NT) {
    const int64_t n = std::min<int64_t>(NT, nq - q0);
    const int64_t j0 = tiled ? *std::min_element(s.first.begin() + q0, s.first.begin() + q0 + n) : 0;
    weigh_values_tail<T, C>(in, blk, s.scores.data(), stride, q0, n, j0, tiled ? s.acc.data() + q0 * C * 16 : nullptr,
                            tiled ? s.total.data() + q0 : nullptr);
  }
}

#endif  // OVERLAP_VARIANT >= 0

// The task function for this call: the vector path when this variant, dtype and head_dim
// have one (and the caller did not ask for the loops), else the reference loops: the same
// bits either way.
template <typename T>
auto choose_attend(int64_t dim, bool reference) -> void (*)(const Inputs<T>&, const Block&, Scratch&) {
#if OVERLAP_VARIANT >= 0
  if constexpr (has_load16<T>) {
    if (!reference) switch (dim) {
      case 16: return attend_vector<T, 1>;
      case 32: return attend_vector<T, 2>;
      case 64: return attend_vector<T, 4>;
      case 128: return attend_vector<T, 8>;
      case 256: return attend_vector<T, 16>;
      default: break;
    }
  }
#endif
  (void)dim;
  (void)reference;
  return attend_reference<T>;
}

// Query rows per task: up to 16, as a block's rows share each key and value load, but fewer
// when the step has so few tasks that the pool's threads would get unequal shares: one
// sequence's 14-row tree verify is 3 tasks (one per kv head), and on 2 threads one thread
// did two while the other idled half the call. Blocks are then cut until the task count
// divides among the threads (14 rows: 2 blocks of 7, 6 tasks).
int64_t block_rows(int64_t num_seqs, int64_t max_q_len, int64_t kv_heads, int64_t threads) {
  int64_t blocks = (max_q_len + 15) / 16;
  const int64_t per_block = num_seqs * kv_heads;
  if (per_block < 4 * threads)
    while (blocks < max_q_len && (per_block * blocks) % threads != 0) ++blocks;
  return (max_q_len + blocks - 1) / blocks;
}

template <typename T>
void run(const Inputs<T>& in, int64_t num_seqs, bool reference) {
  // Tasks: (sequence, kv head, block of query rows). The rows of a block share each key and
  // value load; the split never changes a row's own arithmetic.
  int64_t max_q_len = 1;
  for (int64_t b = 0; b < num_seqs; ++b) max_q_len = std::max<int64_t>(max_q_len, in.q_len[b]);
  const int64_t rows_per_task = block_rows(num_seqs, max_q_len, in.kv_heads, overlap::pool().threads());
  std::vector<int64_t> task_seq, task_row;
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t r = 0; r < in.q_len[b]; r += rows_per_task) {
      task_seq.push_back(b);
      task_row.push_back(r);
    }
  const int64_t tasks = int64_t(task_seq.size()) * in.kv_heads;
  const auto attend = choose_attend<T>(in.dim, reference);
  overlap::parallel_for(tasks, 2, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    Block blk;
    for (int64_t t = t0; t < t1; ++t) {
      plan_block(in, task_seq[t / in.kv_heads], t % in.kv_heads, task_row[t / in.kv_heads], rows_per_task, blk);
      attend(in, blk, scratch);
    }
  });
}

// A tree row's values below value_split(its position) must be keys it sees at their own
// positions (the prefix, then its leading run of ancestors at columns 0, 1, ...): refuse a
// row that sees more than VALUE_MARGIN new tokens past that run. tree [rows, cols].
void check_tree_depth(const bool* tree, int64_t rows, int64_t cols) {
  for (int64_t t = 0; t < rows; ++t) {
    const bool* row = tree + t * cols;
    int64_t run = 0, seen = 0;
    while (run < cols && row[run]) ++run;
    for (int64_t j = run; j < cols; ++j) seen += row[j];
    TORCH_CHECK(seen <= VALUE_MARGIN, "paged_attention: a tree row sees ", seen,
                " new tokens off its leading path; this kernel verifies at most ", VALUE_MARGIN);
  }
}

}  // namespace

// The value cache's pair copy at the given slots, from the value cache: v_all [L, slots, Hkv,
// D], pairs_all [L, pages, Hkv, page_size / 2, D, 2] (KVPool); layer -1: every layer.
void sync_value_pairs(torch::Tensor v_all, torch::Tensor pairs_all, torch::Tensor slots, int64_t page_size,
                      int64_t layer) {
  TORCH_CHECK(v_all.scalar_type() == torch::kBFloat16 && pairs_all.scalar_type() == torch::kBFloat16 &&
                  v_all.is_contiguous() && pairs_all.is_contiguous() && v_all.numel() == pairs_all.numel() &&
                  v_all.dim() == 4 && page_size % 2 == 0,
              "sync_value_pairs: bf16 caches [L, slots, Hkv, D] and their pairs");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64, "sync_value_pairs: int64 slots");
  slots = slots.contiguous();
  const int64_t layers = v_all.size(0), num_slots = v_all.size(1), kv_heads = v_all.size(2), dim = v_all.size(3);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t n = slots.numel();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "sync_value_pairs: slot out of range");
  const uint16_t* v = reinterpret_cast<const uint16_t*>(v_all.data_ptr<at::BFloat16>());
  uint16_t* pairs = reinterpret_cast<uint16_t*>(pairs_all.data_ptr<at::BFloat16>());
  const int64_t per_layer = num_slots * kv_heads * dim;
  for (int64_t l = layer < 0 ? 0 : layer; l < (layer < 0 ? layers : layer + 1); ++l)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t page = slot[i] / page_size, off = slot[i] % page_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const uint16_t* src = v + l * per_layer + (slot[i] * kv_heads + h) * dim;
        uint16_t* dst = pairs + l * per_layer + ((page * kv_heads + h) * (page_size / 2) + off / 2) * dim * 2 + off % 2;
        for (int64_t d = 0; d < dim; ++d) dst[2 * d] = src[d];
      }
    }
}

// q [T, H, D]; k_cache, v_cache [slots, Hkv, D] (the flat paged pool); per sequence b:
// q_start, q_len, kv_len [B] i32, page_table [B, max_pages] i32; tree [T, Qmax] bool or an
// empty tensor (causal): row t's visibility of its own sequence's new tokens. reference: run
// the plain loops (the definition) instead of the vector path, for tests.
// v_pairs: the value cache's copy in key pairs (KVPool.value_pairs), or an empty tensor.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor q_start, torch::Tensor q_len, torch::Tensor kv_len,
                              torch::Tensor page_table, int64_t page_size, torch::Tensor tree,
                              double scale, bool reference, c10::optional<torch::Tensor> v_pairs) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2),
              "paged_attention: q [T, H, D] and caches [slots, Hkv, D]");
  TORCH_CHECK(q.size(2) <= MAX_DIM, "paged_attention: head_dim > ", MAX_DIM);
#if OVERLAP_VARIANT == 3
  TORCH_CHECK(!tile_scored<c10::BFloat16>(q.size(2)) || q.scalar_type() != torch::kBFloat16 || overlap::amx_permitted(),
              "overlap paged_attention: the kernel asked Linux for AMX tile state and was refused");
#endif
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and caches must share a dtype");
  for (auto* t : {&q_start, &q_len, &kv_len, &page_table})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "paged_attention: int32 metadata");
  q = q.contiguous();
  auto out = cpu_empty(q.sizes(), q.scalar_type());
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "paged_attention: heads must be a multiple of kv heads");
  const bool has_tree = tree.defined() && tree.numel() > 0;
  if (has_tree) TORCH_CHECK(tree.scalar_type() == torch::kBool && tree.is_contiguous() && tree.size(0) == q.size(0));
  const bool has_pairs = v_pairs.has_value() && v_pairs->defined() && v_pairs->numel() > 0;
  if (has_pairs)
    TORCH_CHECK(v_pairs->scalar_type() == torch::kBFloat16 && v_pairs->is_contiguous() &&
                    v_pairs->numel() == v_cache.numel() && page_size % 2 == 0,
                "paged_attention: v_pairs is the value cache's pair copy [pages, Hkv, page_size / 2, D, 2]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    Inputs<scalar_t> in{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), q_start.data_ptr<int32_t>(), q_len.data_ptr<int32_t>(),
                              kv_len.data_ptr<int32_t>(), page_table.data_ptr<int32_t>(), page_table.size(1),
                              page_size, has_tree ? tree.data_ptr<bool>() : nullptr, has_tree ? tree.size(1) : 0,
                              heads, kv_heads, dim, float(scale)};
    if (has_pairs && q.scalar_type() == torch::kBFloat16)
      in.vpairs = reinterpret_cast<const uint16_t*>(v_pairs->data_ptr<at::BFloat16>());
    if (has_tree && tile_valued(in)) check_tree_depth(in.tree, tree.size(0), tree.size(1));
    run<scalar_t>(in, q_start.size(0), reference);
  });
  return out;
}
