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
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # One tensor per K and V for all layers; each layer's cache is a contiguous view of it,
        # so a tree's compaction moves its slots in every layer with one gather and one scatter.
        self._k_all = torch.zeros(shape, dtype=dtype, device=device)
        self._v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self._k_all.unbind(0))
        self.v = list(self._v_all.unbind(0))

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
        for cache in (self._k_all, self._v_all):
            slots = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [layers, slots, kv_heads, head_dim]
            slots.index_copy_(1, dst, slots.index_select(1, src))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV at the given slots, for tests and debugging: [N, kv_heads, head_dim] each."""
        k, v = self.flat(layer)
        return k.index_select(0, slots), v.index_select(0, slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._k_all, self._v_all))


def slot_mapping(page_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Flat slot ids of positions start..end-1 of a sequence with this page table."""
    return [page_table[p // page_size] * page_size + p % page_size for p in range(start, end)]
