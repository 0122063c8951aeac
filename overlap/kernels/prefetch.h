// Where the linear kernels' tiles prefetch the next weight block (tile_sums.h): into L1
// (prefetcht0) or into L2 (prefetcht1). Chosen once per process by the kernels' loader
// (kernels/__init__.py says which machines take which), before the first call.
//
// Why two: on an Intel Xeon (Emerald Rapids, AMX hidden, avx512bf16) whole target forwards ran
// 0.86-0.90 of their time at 1 row with the prefetches into L2, 0.90-0.96 at 5 rows, 0.97 at
// 14, 0.98-0.99 at batch 8 (runs/prof/prefetch_ab.py, round-robin in one process): a core's
// few L1 fill buffers, held by prefetches to L1, cap how much of the stream is in flight,
// while L2 takes more. On an AMD EPYC Zen 5 the L2 prefetches were slower (1 row 1.07x,
// docs/fast_steps.md, "Session 34").
#pragma once

namespace overlap {

extern bool prefetch_into_l2;

inline void prefetch_line(const char* line) {
  if (prefetch_into_l2)
    __builtin_prefetch(line, 0, 2);
  else
    __builtin_prefetch(line);
}

}  // namespace overlap
