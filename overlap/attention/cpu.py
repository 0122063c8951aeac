"""Paged attention for the CPU on overlap's compiled kernel (overlap/kernels/attention.cpp).

Batch-invariant by construction (each query row runs the same fixed-order arithmetic whatever
shares the step: f32 math, bf16 scores on AMX tiles where the CPU has them), keys and values
read in place through the page table: no per-layer gather of the context, no mask tensor, no
float64. Planning is tensor arithmetic over the page tables, once per step; every layer
reuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from overlap.attention.base import SeqAttention
from overlap.device import upload
from overlap.kernels import paged_attention
from overlap.kv import KVPool, slot_mapping


@dataclass(frozen=True)
class CpuMetadata:
    slots: torch.Tensor  # [T] i64 flat KV slot of every new token
    q_start: torch.Tensor  # [B] i32 first row of each sequence in the flat q
    q_len: torch.Tensor  # [B] i32
    kv_len: torch.Tensor  # [B] i32 cached + new
    page_table: torch.Tensor  # [B, max_pages] i32 (padding: 0, never read)
    page_size: int
    tree: torch.Tensor | None  # [T, Qmax] bool: row t's view of its sequence's new tokens


class CpuBackend:
    name = "cpu"

    def plan(self, seqs: list[SeqAttention], page_size: int, num_heads: int = 0,
             num_kv_heads: int = 0, head_dim: int = 0, dtype: torch.dtype = torch.float32
             ) -> CpuMetadata:
        # Plain Python over the step's lists, then one tensor per field: a plan runs before
        # every target pass and every head or draft pass, and a dozen small tensor ops cost
        # 0.25 ms a plan on a 2-core CPU (four plans a step for mtp:3: ~0.1 of a decode step).
        width = max(len(s.page_table) for s in seqs)
        q_start, slots, row = [], [], 0
        for s in seqs:
            q_start.append(row)
            row += s.q_len
            slots += slot_mapping(s.page_table, s.kv_len - s.q_len, s.kv_len, page_size)
        # Through the CPU staging (numpy): torch.tensor(list) hands the GIL to the other Python
        # thread (the stream's worker, or the host planning the next step) and waits for it back.
        staged = upload("cpu", (slots, torch.long), (q_start, torch.int32), ([s.q_len for s in seqs], torch.int32),
                        ([s.kv_len for s in seqs], torch.int32),
                        ([s.page_table + [0] * (width - len(s.page_table)) for s in seqs], torch.int32))
        return CpuMetadata(*staged, page_size, _tree_rows(seqs, row))

    def run(self, layer: int, q: torch.Tensor, kv: KVPool, meta: CpuMetadata) -> torch.Tensor:
        k, v = kv.flat(layer)
        return paged_attention(q, k, v, meta.q_start, meta.q_len, meta.kv_len, meta.page_table,
                               meta.page_size, meta.tree, 1.0 / math.sqrt(q.shape[-1]),
                               v_pairs=kv.value_pairs(layer))


def _tree_rows(seqs: list[SeqAttention], num_rows: int) -> torch.Tensor | None:
    """[T, Qmax] bool visibility of each row over its own sequence's new tokens, when any
    sequence carries a tree mask (the others get their causal rows); None when all are causal."""
    if all(s.tree_mask is None for s in seqs):
        return None
    only, q_len = seqs[0].tree_mask, seqs[0].q_len
    if (len(seqs) == 1 and only.shape == (q_len, q_len) and only.dtype == torch.bool
            and only.device.type == "cpu" and only.is_contiguous()):
        # One sequence: its mask is the table, shared, not copied (no zeros tensor and slice
        # write: 19 -> 16 us a plan); masks are built per step and never written after.
        return only
    width = max(s.q_len for s in seqs)
    tree = torch.zeros(num_rows, width, dtype=torch.bool)
    row = 0
    for s in seqs:
        mask = s.tree_mask if s.tree_mask is not None else torch.ones(s.q_len, s.q_len, dtype=torch.bool).tril()
        tree[row: row + s.q_len, : s.q_len] = mask
        row += s.q_len
    return tree
