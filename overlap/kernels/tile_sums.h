// The register tile the two linear kernels share (linear_bf16.cpp, linear_int8.cpp): rows
// r0..r0+R of x against one column block of NB outputs in R x VECS accumulators, each
// output's lane walking k in order (the same instructions for any M: batch invariance), the
// sums handed back as f32 for the kernel's own epilogue (bias; int8's scales).
//
// Included inside a kernel's anonymous namespace, after its variant's Acc, zero, load_w,
// bcast_x, madd, store and VEC, VECS, KSTEP, NB: the arithmetic is the kernel's, the loop
// is this one.
template <int R, typename X, typename W>
inline void tile_sums(const X* x, int64_t xk, const W* block, int64_t kp, int64_t r0, float (&sums)[R][NB]) {
  Acc acc[R][VECS];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = zero();
  for (int64_t k = 0; k < kp; k += KSTEP) {
    const W* wk = block + k * NB;  // NB outputs x KSTEP k values, contiguous
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
