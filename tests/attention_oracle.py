"""Random paged batches and a dense oracle, shared by the attention tests and tools/gpu_check.py
(test code: it lives in tests/, outside the package; gpu_check puts tests/ on its path).

A batch is described by `SeqSpec`s (cached prefix, new tokens, causal or tree). The builder
scatters every sequence over shuffled pages of a pool whose other slots and other layer hold
large garbage, so a backend that reads a wrong page, a slot past kv_len or the wrong layer
fails loudly instead of averaging in plausible values. The oracle is plain dense attention in
float64 over the same dtype-rounded q/k/v, written independently of the reference backend.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from overlap.attention.base import SeqAttention, tree_mask_from_parents
from overlap.kv import KVPool, slot_mapping

# Batch kinds that the tests and the GPU check both cover.
KINDS = ("decode", "mixed", "verify", "tree")
# Queries are scaled up so the softmax is peaked: a key wrongly let in (or left out) by a
# mask or page-table bug then moves the output well past the bf16 tolerance, instead of
# being diluted into a flat average over hundreds of keys.
Q_SCALE = 2.0
# Unused slots and the other layer hold randn * GARBAGE (finite: masked slots may still be
# loaded and multiplied by p = 0, and 0 * inf would poison correct rows with NaN).
GARBAGE = 50.0


@dataclass(frozen=True)
class SeqSpec:
    cached: int  # tokens already in the KV cache
    new: int  # tokens of this step (q_len)
    tree: bool = False  # a random tree mask over the new tokens; else causal
    reserve: int = 0  # extra pages at the end of the page table (reserved for later steps)


@dataclass(frozen=True)
class PagedBatch:
    pool: KVPool  # 2 layers; only `layer` holds the sequences' K/V
    layer: int
    seqs: list[SeqAttention]
    q: torch.Tensor  # [T, H, D] dtype, on the pool's device
    expected: torch.Tensor  # [T, H, D] f64 on the CPU: the dense oracle
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def plan(self, backend):
        """The backend's metadata for this batch (one step)."""
        return backend.plan(self.seqs, self.page_size, self.num_heads, self.num_kv_heads,
                            self.head_dim, self.dtype)


def random_specs(kind: str, rng: random.Random, batch: int | None = None,
                 max_cached: int = 200) -> list[SeqSpec]:
    """A random batch of one kind: decode (q_len 1), mixed (prefills, prefix prefills and
    decodes), verify (q_len 5 after a prefix) or tree (tree drafts mixed with causal rows)."""
    n = batch if batch is not None else rng.randint(1, 8)

    def reserve() -> int:
        return rng.choice([0, 0, 1, 2])

    if kind == "decode":
        return [SeqSpec(rng.randint(1, max_cached), 1, reserve=reserve()) for _ in range(n)]
    if kind == "verify":
        return [SeqSpec(rng.randint(1, max_cached), 5, reserve=reserve()) for _ in range(n)]
    if kind == "mixed":
        out = []
        for _ in range(n):
            sub = rng.choice(["prefill", "prefix_prefill", "decode"])
            cached = 0 if sub == "prefill" else rng.randint(1, max_cached)
            new = {"prefill": rng.randint(1, 100), "prefix_prefill": rng.randint(17, 60),
                   "decode": 1}[sub]
            out.append(SeqSpec(cached, new, reserve=reserve()))
        # A mixed batch must not collapse into a decode-only one (that is another path).
        if all(s.new == 1 for s in out):
            out[0] = SeqSpec(out[0].cached, rng.randint(2, 40), reserve=out[0].reserve)
        return out
    if kind == "tree":
        out = []
        for _ in range(n):
            sub = rng.choice(["tree", "tree", "decode", "verify"])
            new = {"tree": rng.randint(2, 12), "decode": 1, "verify": 5}[sub]
            out.append(SeqSpec(rng.randint(0 if sub == "tree" else 1, max_cached), new,
                               tree=sub == "tree", reserve=reserve()))
        if not any(s.tree for s in out):
            out[0] = SeqSpec(out[0].cached, 6, tree=True, reserve=out[0].reserve)
        return out
    raise ValueError(f"unknown batch kind {kind!r} (one of {KINDS})")


def random_tree_mask(n: int, rng: random.Random) -> torch.Tensor:
    """[n, n] bool: node i sees itself and its ancestors; node 0 is the root and every
    parent comes before its child (how draft trees are laid out)."""
    return tree_mask_from_parents([-1] + [rng.randrange(i) for i in range(1, n)])


def random_paged_batch(specs: list[SeqSpec], page_size: int, num_heads: int = 9,
                       num_kv_heads: int = 3, head_dim: int = 64,
                       dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                       seed: int = 0) -> PagedBatch:
    """Build the pool, the step's SeqAttention list, q and the dense oracle.

    Every sequence's K/V (prefix and new tokens) is already in the pool, as after the
    model's `kv.write` of this step. Defaults are SmolLM2-135M's attention shape (GQA 3).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layer = 1
    pages_needed = [-(-(s.cached + s.new) // page_size) + s.reserve for s in specs]
    num_pages = sum(pages_needed) + 3
    pool = KVPool(2, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
    for cache in pool.k + pool.v:
        cache.copy_(torch.randn(cache.shape, generator=gen) * GARBAGE)
    free = list(range(num_pages))
    rng.shuffle(free)  # pages out of order, like a fragmented pool

    seqs, qs, expected = [], [], []
    for spec, n_pages in zip(specs, pages_needed):
        kv_len = spec.cached + spec.new
        table = [free.pop() for _ in range(n_pages)]
        k = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        q = (torch.randn(spec.new, num_heads, head_dim, generator=gen) * Q_SCALE).to(dtype)
        slots = torch.tensor(slot_mapping(table, 0, kv_len, page_size), device=device)
        pool.write(layer, slots, k.to(device), v.to(device))
        tree = random_tree_mask(spec.new, rng) if spec.tree else None
        seqs.append(SeqAttention(spec.new, kv_len, table, tree))
        qs.append(q)
        expected.append(dense_attention(q, k, v, step_mask(spec.new, kv_len, tree)))
    return PagedBatch(pool, layer, seqs, torch.cat(qs).to(device), torch.cat(expected),
                      page_size, num_heads, num_kv_heads, head_dim, dtype)


def step_mask(q_len: int, kv_len: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[q_len, kv_len] bool: the whole cached prefix, then the tree mask or causal."""
    mask = torch.ones(q_len, kv_len, dtype=torch.bool)
    new = tree_mask if tree_mask is not None else torch.ones(q_len, q_len, dtype=torch.bool).tril()
    mask[:, kv_len - q_len:] = new
    return mask


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """q [Q, H, D], k/v [L, Hkv, D], mask [Q, L] bool → [Q, H, D] f64 (CPU)."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().cpu().double() for t in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)  # head h → kv h // group
    scores = torch.einsum("qhd,lhd->hql", qd, kd) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask.cpu()[None], float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), vd)


def max_abs_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |out - expected| (NaN counts as infinitely wrong)."""
    diff = (out.detach().cpu().double() - expected.cpu().double()).abs()
    return math.inf if torch.isnan(diff).any() else float(diff.max()) if diff.numel() else 0.0
