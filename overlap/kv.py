"""Paged KV storage. Page tables are not here: the scheduler owns them (one per sequence,
shared by the target and draft pools), and every step says which pages to use."""

from __future__ import annotations

import torch


class KVPool:
    """K and V caches for every layer of one model, each [num_pages, page_size, kv_heads, head_dim].

    The NHD page layout is the one FlashInfer's paged wrappers take as a (k, v) tuple, so the
    same storage serves the reference and the FlashInfer backends.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] i64 = page * page_size + offset; k, v [T, kv_heads, head_dim]."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's caches as [num_pages * page_size, kv_heads, head_dim] slot arrays."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move KV entries between slots in every layer (tree compaction); src, dst [N] i64."""
        for layer in range(len(self.k)):
            for cache in self.flat(layer):
                cache.index_copy_(0, dst, cache.index_select(0, src))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV at the given slots, for tests and debugging: [N, kv_heads, head_dim] each."""
        k, v = self.flat(layer)
        return k.index_select(0, slots), v.index_select(0, slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def slot_mapping(page_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Flat slot ids of positions start..end-1 of a sequence with this page table."""
    return [page_table[p // page_size] * page_size + p % page_size for p in range(start, end)]
