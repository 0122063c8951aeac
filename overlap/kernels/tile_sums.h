// The register tile the two linear kernels share (linear_bf16.cpp, linear_int8.cpp): rows
// r0..r0+R of x against one column block of NB outputs in R x VECS accumulators, each
// output's lane walking k in order (the same instructions for any M: batch invariance), the
// sums handed back as f32 for the kernel's own epilogue (bias; int8's scales).
//
// `ahead` (optional): another packed block, the next one the thread will read, prefetched line
// by line as this one is walked, so that memory keeps streaming while the tile computes from
// cache; `part` of `parts`: this tile prefetches the lines of every parts-th k step only, so
// that the tiles walking one block share the next one's prefetch (linear_bf16.cpp's
// rows_of_block says why).
//
// Included inside a kernel's anonymous namespace, after its variant's Acc, zero, load_w,
// bcast_x, madd, store and VEC, VECS, KSTEP, NB: the arithmetic is the kernel's, the loop
// is this one.
template <int R, typename X, typename W, typename A = W>
inline void tile_sums(const X* x, int64_t xk, const W* block, int64_t kp, int64_t r0, float (&sums)[R][NB],
                      const A* ahead = nullptr, int part = 0, int parts = 1) {
  Acc acc[R][VECS];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = zero();
  int phase = (parts - part) % parts;  // 0 on this tile's k steps: step ≡ part (mod parts), no division
  for (int64_t k = 0; k < kp; k += KSTEP) {
    const W* wk = block + k * NB;  // NB outputs x KSTEP k values, contiguous
    if (ahead && phase == 0)  // this k's NB x KSTEP values of the next block, in 64-byte lines
      for (int64_t byte = 0; byte < int64_t(NB * KSTEP * sizeof(A)); byte += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(ahead + k * NB) + byte);
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
