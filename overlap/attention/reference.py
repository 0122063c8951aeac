"""Pure-torch paged attention for the CPU (and as the oracle for the FlashInfer backend).

Exactness by construction: the scores, softmax and weighted sum run in float64 and are
rounded to the model dtype once at the end. Batched and single-sequence runs, a verify pass
over k+1 tokens and k+1 single-token decode steps then give bit-identical outputs, whatever
the padding or grouping (float32 accumulation order differs between those shapes and flips
greedy near-ties; float64 error is far below one bf16/f32 ulp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from overlap.attention.base import SeqAttention
from overlap.kv import KVPool, slot_mapping

# Sequences with at most this many new tokens (decode, verify, small trees) are padded into
# one group; longer ones (prefill chunks) run one by one, so padding never costs q_len * kv.
SMALL_Q = 16


@dataclass(frozen=True)
class _Group:
    q_index: torch.Tensor  # [B, Qmax] i64 rows of the flat q (padding: 0)
    q_valid: torch.Tensor  # [B, Qmax] bool
    kv_slots: torch.Tensor  # [B, Lmax] i64 (padding: 0, masked out)
    mask: torch.Tensor  # [B, Qmax, Lmax] bool, True = may attend


@dataclass(frozen=True)
class ReferenceMetadata:
    slots: torch.Tensor  # [T] i64
    groups: list[_Group]


class ReferenceBackend:
    name = "reference"

    def plan(self, seqs: list[SeqAttention], page_size: int, num_heads: int = 0,
             num_kv_heads: int = 0, head_dim: int = 0, dtype: torch.dtype = torch.float32
             ) -> ReferenceMetadata:
        slots: list[int] = []
        starts: list[int] = []
        for s in seqs:
            starts.append(len(slots))
            slots += slot_mapping(s.page_table, s.kv_len - s.q_len, s.kv_len, page_size)
        small = [i for i, s in enumerate(seqs) if s.q_len <= SMALL_Q]
        large = [[i] for i, s in enumerate(seqs) if s.q_len > SMALL_Q]
        groups = [_plan_group([seqs[i] for i in idx], [starts[i] for i in idx], page_size)
                  for idx in ([small] if small else []) + large]
        return ReferenceMetadata(slots=torch.tensor(slots, dtype=torch.long), groups=groups)

    def run(self, layer: int, q: torch.Tensor, kv: KVPool, meta: ReferenceMetadata) -> torch.Tensor:
        k_flat, v_flat = kv.flat(layer)  # [slots, Hkv, D]
        out = torch.empty_like(q)
        for g in meta.groups:
            res = _attend(q[g.q_index], k_flat[g.kv_slots], v_flat[g.kv_slots], g.mask)
            out[g.q_index[g.q_valid]] = res[g.q_valid].to(q.dtype)
        return out


def _plan_group(seqs: list[SeqAttention], q_starts: list[int], page_size: int) -> _Group:
    q_lens = torch.tensor([s.q_len for s in seqs])
    kv_lens = torch.tensor([s.kv_len for s in seqs])
    q_max, l_max = int(q_lens.max()), int(kv_lens.max())
    rows = torch.arange(q_max)[None, :]  # [1, Qmax]
    q_valid = rows < q_lens[:, None]
    q_index = torch.where(q_valid, torch.tensor(q_starts)[:, None] + rows, 0)
    kv_slots = torch.zeros(len(seqs), l_max, dtype=torch.long)
    for b, s in enumerate(seqs):
        kv_slots[b, : s.kv_len] = torch.tensor(slot_mapping(s.page_table, 0, s.kv_len, page_size))
    # Causal: query i of a sequence sits at position prefix + i and sees keys 0 .. prefix + i.
    prefix = (kv_lens - q_lens)[:, None, None]
    cols = torch.arange(l_max)[None, None, :]
    mask = cols <= prefix + rows[..., None]
    for b, s in enumerate(seqs):
        if s.tree_mask is not None:
            p = s.kv_len - s.q_len
            mask[b, : s.q_len, p: s.kv_len] = s.tree_mask
    # Padding rows attend to slot 0 only, so their softmax is finite; they are discarded.
    mask &= q_valid[..., None]
    mask[:, :, 0] |= ~q_valid
    return _Group(q_index, q_valid, kv_slots, mask)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, Q, H, D], k/v [B, L, Hkv, D], mask [B, Q, L] → [B, Q, H, D] f64."""
    b, q_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # Query head h reads kv head h // group (GQA): fold the group into the query rows.
    qh = q.double().view(b, q_len, kv_heads, group, dim).permute(0, 2, 1, 3, 4)
    qh = qh.reshape(b, kv_heads, q_len * group, dim)
    kh = k.double().permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    vh = v.double().permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    scores = (qh @ kh) * (1.0 / math.sqrt(dim))
    allowed = mask[:, None, :, None, :].expand(b, 1, q_len, group, mask.shape[-1])
    scores = scores.masked_fill(~allowed.reshape(b, 1, q_len * group, -1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh  # [B, Hkv, Q*G, D]
    return out.view(b, kv_heads, q_len, group, dim).permute(0, 2, 1, 3, 4).reshape(b, q_len, heads, dim)
