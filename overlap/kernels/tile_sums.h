// The register tile the two linear kernels share (linear_bf16.cpp, linear_int8.cpp): rows
// r0..r0+R of x against one column block of NB outputs in R x VECS accumulators, each
// output's lane walking k in order (the same instructions for any M: batch invariance), the
// sums handed back as f32 for the kernel's own epilogue (bias; int8's scales).
//
// `ahead` (optional): another packed block, the next one the thread will read, prefetched line
// by line as this one is walked, so that memory keeps streaming while the tile computes from
// cache; `part` of `parts`: this tile prefetches its share of it only, so that the tiles
// walking one block share the next one's prefetch (below says which share;
// linear_bf16.cpp's rows_of_block says why).
//
// Included inside a kernel's anonymous namespace, after its variant's Acc, zero, load_w,
// bcast_x, madd, store and VEC, VECS, KSTEP, NB, and after prefetch.h (where the prefetches
// go): the arithmetic is the kernel's, the loop is this one.
template <int R, typename X, typename W, typename A = W>
inline void tile_sums(const X* x, int64_t xk, const W* block, int64_t kp, int64_t r0, float (&sums)[R][NB],
                      const A* ahead = nullptr, int part = 0, int parts = 1) {
  Acc acc[R][VECS];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = zero();
  // This tile's share of the next block, one k step's values (NB x KSTEP) every `parts` steps
  // of its own walk. Where a step fills whole 64-byte lines: the part-th contiguous run of
  // steps, so that the tiles together stream the block in order (the hardware prefetchers
  // follow it; every parts-th step instead left holes in the stream, and a 12-row verify cost
  // ~2.0 ms more than a 1-row pass in the model's linears, ~0.8 in order: Zen 5, avx512bf16,
  // runs/prof/linear_rows.py). Where a step is half a line (AVX2, scalar: NB x 2 bytes = 32),
  // every parts-th step from the part-th: each tile then touches most of the block's lines,
  // and in order it was slower there (Zen 5 capped to AVX2: 9 rows 13.5-14.1 -> 14.4-17.4 ms).
  constexpr bool in_order = NB * KSTEP * sizeof(A) >= 64;
  const int64_t steps = kp / KSTEP;
  int64_t ahead_step = in_order ? steps * part / parts : part;
  const int64_t ahead_end = in_order ? steps * (part + 1) / parts : steps;
  const int64_t stride = in_order ? 1 : parts;
  int phase = 0;
  for (int64_t k = 0; k < kp; k += KSTEP) {
    const W* wk = block + k * NB;  // NB outputs x KSTEP k values, contiguous
    if (ahead && phase == 0 && ahead_step < ahead_end) {
      const char* line = reinterpret_cast<const char*>(ahead + ahead_step * KSTEP * NB);
      for (int64_t byte = 0; byte < int64_t(NB * KSTEP * sizeof(A)); byte += 64) overlap::prefetch_line(line + byte);
      ahead_step += stride;
    }
    if (++phase == parts) phase = 0;
    decltype(load_w(wk)) w[VECS];
    for (int v = 0; v < VECS; ++v) w[v] = load_w(wk + v * VEC * KSTEP);
    for (int r = 0; r < R; ++r) {
      auto xv = bcast_x(x + (r0 + r) * xk + k);
      for (int v = 0; v < VECS; ++v) acc[r][v] = madd(acc[r][v], xv, w[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECS; ++v) store(sums[r] + v * VEC, acc[r][v]);
}
