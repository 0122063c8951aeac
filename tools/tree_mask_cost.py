"""What the tree mask costs: the target's verify pass over a draft tree (tree attention
mask) against a plain causal pass over the same number of tokens, same prefix lengths.

    python tools/tree_mask_cost.py [--batch 1 8] [--prefix 256] [--tokens 8] [--device cuda]

The reference backend (CPU) applies the mask to the new-token block only: every row sees
the whole cached prefix, and the [q, q] tree block is where the mask differs from causal.
FlashInfer's custom mask must cover each request's full [q_len, kv_len] matrix (prefix
columns included); the backend packs it on the host (overlap/attention/flashinfer.py).
Prints the median step time of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overlap.attention import SeqAttention, make_backend  # noqa: E402
from overlap.attention.base import tree_mask_from_parents  # noqa: E402
from overlap.models.llama import load_llama  # noqa: E402
from overlap.models.loading import resolve_model_dir  # noqa: E402
from overlap.speculative.tree import TreeShape  # noqa: E402


def time_pass(model, backend, kv, seqs, ids, positions, repeats: int, sync) -> float:
    dims = (model.cfg.num_heads, model.cfg.num_kv_heads, model.cfg.head_dim, model.dtype)
    rows = torch.arange(ids.shape[0], device=ids.device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        meta = backend.plan(seqs, kv.page_size, *dims)
        model(ids, positions, backend, kv, meta, rows)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    model = load_llama(resolve_model_dir(None, progress=True), torch.bfloat16, dev)
    backend = make_backend("auto", dev)
    shape = TreeShape.default(args.depth, args.topk, args.tokens)
    q = shape.size + 1
    mask = tree_mask_from_parents([-1] + shape.parents())
    depths = [0] + shape.depths()
    page = 16
    print(f"tree: {shape.size} nodes, depth {shape.depth}; prefix {args.prefix}; {model.dtype}; "
          f"backend {backend.name}; device {dev}")
    print("batch  causal ms  tree-mask ms  ratio")
    for b in args.batch:
        pages_per = -(-(args.prefix + q) // page)
        kv = model.new_kv_pool(b * pages_per, page)
        tables = [list(range(i * pages_per, (i + 1) * pages_per)) for i in range(b)]
        ids = torch.randint(0, model.cfg.vocab_size, (b * q,), device=dev)
        causal_pos = torch.cat([torch.arange(args.prefix, args.prefix + q) for _ in range(b)]).to(dev)
        tree_pos = torch.cat([torch.tensor([args.prefix + d for d in depths]) for _ in range(b)]).to(dev)
        causal = [SeqAttention(q, args.prefix + q, t) for t in tables]
        tree = [SeqAttention(q, args.prefix + q, t, tree_mask=mask) for t in tables]
        c = time_pass(model, backend, kv, causal, ids, causal_pos, args.repeats, sync)
        m = time_pass(model, backend, kv, tree, ids, tree_pos, args.repeats, sync)
        print(f"{b:5d}  {c:9.2f}  {m:12.2f}  {m / c:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
