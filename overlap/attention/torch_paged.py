"""Paged attention in plain torch on any device: the CUDA fallback when FlashInfer is not
installed, and what `--attention-backend reference` means on CUDA.

The math is the reference backend's (overlap/attention/reference.py): float64 scores,
softmax and weighted sum over the keys gathered through the page table, rounded to the
model dtype once; causal or tree masks; so its outputs are batch-invariant by construction,
like the reference's. What differs is where the metadata lives: the reference plans CPU
index tensors (a CUDA `index_copy_` with CPU indices fails), this backend plans the same
indices and masks on the host and stages them to the device in ONE pinned, non_blocking
copy (overlap.device.upload), so planning never blocks on the device.

No CUDA graphs: its gathers are sized by the step's longest context, which a graph cannot
fix; the graph runner runs its buckets eagerly and says so (overlap/graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overlap.attention.base import SeqAttention
from overlap.attention.reference import ReferenceBackend, _attend
from overlap.device import host_io, upload
from overlap.kv import KVPool


@dataclass(frozen=True)
class TorchGroup:
    q_index: torch.Tensor  # [B, Qmax] i64 rows of the flat q (padding: 0)
    dest: torch.Tensor  # [B * Qmax] i64 output row of each (padding: T, a throwaway row)
    kv_slots: torch.Tensor  # [B, Lmax] i64
    mask: torch.Tensor  # [B, Qmax, Lmax] bool, True = may attend


@dataclass(frozen=True)
class TorchMetadata:
    slots: torch.Tensor  # [T] i64 flat KV slot of every new token
    groups: list[TorchGroup]


class TorchBackend:
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._ref = ReferenceBackend()

    def plan(self, seqs: list[SeqAttention], page_size: int, num_heads: int = 0,
             num_kv_heads: int = 0, head_dim: int = 0, dtype: torch.dtype = torch.float32
             ) -> TorchMetadata:
        # Host work: the reference planner's CPU tensors, then one staged copy of all of them.
        with host_io():
            meta = self._ref.plan(seqs, page_size, num_heads, num_kv_heads, head_dim, dtype)
            total = meta.slots.shape[0]
            arrays = [(meta.slots.numpy(), torch.long)]
            for g in meta.groups:
                dest = torch.where(g.q_valid, g.q_index, total).reshape(-1)
                arrays += [(g.q_index.numpy(), torch.long), (dest.numpy(), torch.long),
                           (g.kv_slots.numpy(), torch.long), (g.mask.numpy(), torch.bool)]
        staged = upload(self.device, *arrays)
        groups = [TorchGroup(*staged[i: i + 4]) for i in range(1, len(staged), 4)]
        return TorchMetadata(slots=staged[0], groups=groups)

    def run(self, layer: int, q: torch.Tensor, kv: KVPool, meta: TorchMetadata) -> torch.Tensor:
        """q [T, H, D] → [T, H, D] in q's dtype; no host sync (no boolean-mask indexing)."""
        k_flat, v_flat = kv.flat(layer)  # [slots, Hkv, D]
        out = torch.empty((q.shape[0] + 1, *q.shape[1:]), dtype=q.dtype, device=q.device)
        for g in meta.groups:
            res = _attend(q[g.q_index], k_flat[g.kv_slots], v_flat[g.kv_slots], g.mask)
            out[g.dest] = res.reshape(-1, *q.shape[1:]).to(q.dtype)
        return out[:-1]
