"""The attention backend protocol.

A step's attention is described on the host, per sequence (`SeqAttention`), and turned into
device metadata once per step by `plan` (CPU work that the runtime overlaps with the device).
Every layer then calls `run` with the same metadata. New K/V are written into the paged pool
at `meta.slots` before `run`, so each query sees its own key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from overlap.device import upload
from overlap.kv import KVPool


@dataclass(frozen=True)
class SeqAttention:
    """One sequence in a step: q_len new tokens appended after kv_len - q_len cached ones."""

    q_len: int
    kv_len: int  # cached + new
    page_table: list[int]
    # [q_len, q_len] bool: which new tokens each new token may see (tree drafts); None = causal.
    # The cached prefix is always fully visible.
    tree_mask: torch.Tensor | None = None


class AttentionMetadata(Protocol):
    slots: torch.Tensor  # [T] i64 flat KV slot of every new token


class AttentionBackend(Protocol):
    name: str

    def plan(self, seqs: list[SeqAttention], page_size: int, num_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> Any:
        """Host-side planning for one step; returns metadata with at least `slots`."""
        ...

    def run(self, layer: int, q: torch.Tensor, kv: KVPool, meta: Any) -> torch.Tensor:
        """q [T, H, D] → attention output [T, H, D] in q's dtype."""
        ...


def tree_mask_from_parents(parents: list[int]) -> torch.Tensor:
    """[n, n] bool ancestor mask of a draft tree: node i sees itself and its ancestors.
    parents[i] is node i's parent (-1 for the root); parents come before their children.
    Shared between calls with the same parents (every reader only reads it): a step's trees
    repeat a handful of shapes (the fixed tree, its chains, each with a branch of 1..L)."""
    key = tuple(parents)
    mask = _masks.get(key)
    if mask is None:
        if len(_masks) >= 1024:  # EAGLE-2's grown trees vary: bounded
            _masks.clear()
        mask = _masks[key] = _ancestor_mask(parents)
    return mask


_masks: dict[tuple[int, ...], torch.Tensor] = {}


def _ancestor_mask(parents: list[int]) -> torch.Tensor:
    # Python lists, then one tensor (the CPU staging): a tensor write per (node, ancestor) cost
    # ~10 us each, 0.13 ms for a 5-node tree with an 8-token branch, planned every step.
    n = len(parents)
    rows = []
    for i in range(n):
        row, j = [False] * n, i
        while j != -1:
            row[j] = True
            j = parents[j]
        rows.append(row)
    return upload("cpu", (rows, torch.bool))[0].reshape(n, n)
