"""Microbenchmark of the CPU paged-attention kernel (overlap/kernels/attention.cpp) on
SmolLM2-135M shapes: 9 query heads, 3 KV heads, head_dim 64, page size 16, bf16 pool.

Each case builds one step (decode, verify, tree verify, prefill) over a fragmented pool and
times the kernel call alone; the figure is the minimum over many repetitions, which is
robust to other processes on a shared machine (interference only ever adds time).

    nice -n 19 python tools/attention_bench.py [--threads 1] [--reps 30] [--only decode]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from overlap.attention import SeqAttention
from overlap.attention.base import tree_mask_from_parents
from overlap.attention.cpu import CpuBackend
from overlap.config import SpecConfig, default_tree_tokens
from overlap.kernels import variant_name
from overlap.kv import KVPool
from overlap.speculative.tree import TreeShape

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16


def make_case(seqs: list[tuple[int, int]], tree: torch.Tensor | None = None, seed: int = 0):
    """seqs: (cached, new) per sequence → (run, rows): a closure running one kernel call."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pages_of = [-(-(c + n) // PAGE) for c, n in seqs]
    pool = KVPool(1, sum(pages_of) + 1, PAGE, KV_HEADS, DIM, torch.bfloat16)
    pool.k[0].normal_()
    pool.v[0].normal_()
    pool.sync_value_pairs()  # V was written directly: its pair copy (AMX value tiles) follows
    free = list(range(sum(pages_of) + 1))
    rng.shuffle(free)  # pages out of order, like a pool after some traffic
    attn = [SeqAttention(n, c + n, [free.pop() for _ in range(p)], tree)
            for (c, n), p in zip(seqs, pages_of)]
    rows = sum(n for _, n in seqs)
    q = torch.randn(rows, HEADS, DIM).to(torch.bfloat16)  # [T, H, D] bf16
    backend = CpuBackend()
    meta = backend.plan(attn, PAGE)
    return (lambda: backend.run(0, q, pool, meta)), rows


def min_ms(run, reps: int, min_seconds: float) -> float:
    """Minimum wall time of one call over at least `reps` calls and `min_seconds`."""
    run()  # warm: the library load, the page-ins
    best, start, n = float("inf"), time.perf_counter(), 0
    while n < reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best * 1e3


def cases() -> list[tuple[str, list[tuple[int, int]], torch.Tensor | None]]:
    out = []
    for ctx in (256, 1024):
        for batch in (1, 8, 64):
            out.append((f"decode b={batch} ctx={ctx}", [(ctx - 1, 1)] * batch, None))
    for rows in (4, 9):
        out.append((f"verify {rows} rows b=8 ctx=256", [(256 - rows, rows)] * 8, None))
    # EAGLE-like tree of 9 nodes: root, 2 children, each with 2 children, 2 grandchildren.
    tree = tree_mask_from_parents([-1, 0, 0, 1, 1, 2, 2, 3, 5])
    out.append(("tree 9 nodes b=8 ctx=256", [(256 - 9, 9)] * 8, tree))
    # Batch 1, EAGLE's default tree with its root, and with an 8-token lookup branch as one
    # more child of the root: what a batch-1 verify pass reads a layer.
    spec = SpecConfig()
    shipped = [-1] + TreeShape.default(spec.tree_depth, spec.tree_topk, default_tree_tokens("cpu")).parents()
    n, branch = len(shipped), [0] + list(range(len(shipped), len(shipped) + 7))
    out.append(("decode b=1 ctx=300", [(299, 1)], None))
    out.append((f"tree {n - 1} nodes b=1 ctx=300", [(300 - n, n)], tree_mask_from_parents(shipped)))
    out.append((f"tree {n - 1} nodes + branch 8 b=1 ctx=300", [(300 - n - 8, n + 8)],
                tree_mask_from_parents(shipped + branch)))
    out.append(("prefill 8x257", [(0, 257)] * 8, None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="kernel threads (torch intra-op)")
    parser.add_argument("--reps", type=int, default=30, help="at least this many timed calls per case")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="and at least this long per case")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"variant {variant_name()}, {args.threads} thread(s), min of >= {args.reps} calls / {args.min_seconds} s")
    print(f"| case | rows | ms/call (min) |\n|---|---:|---:|")
    for name, seqs, tree in cases():
        if args.only not in name:
            continue
        run, rows = make_case(seqs, tree)
        print(f"| {name} | {rows} | {min_ms(run, args.reps, args.min_seconds):.3f} |", flush=True)


if __name__ == "__main__":
    main()
