"""Paged KV storage. Page tables are not here: the scheduler owns them (one per sequence,
shared by the target and draft pools), and every step says which pages to use."""

from __future__ import annotations

import torch

from overlap import kernels


class KVPool:
    """K and V caches for every layer of one model, each [num_pages, page_size, kv_heads, head_dim].

    The NHD page layout is the one FlashInfer's paged wrappers take as a (k, v) tuple, so the
    same storage serves the reference and the FlashInfer backends.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 value_pairs: bool | None = None):
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # One tensor per K and V for all layers; each layer's cache is a contiguous view of it,
        # so a tree's compaction moves its slots in every layer with one gather and one scatter.
        self._k_all = torch.zeros(shape, dtype=dtype, device=device)
        self._v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self._k_all.unbind(0))
        self.v = list(self._v_all.unbind(0))
        # On AMX CPUs the attention kernel sums the values of a row's older keys on tiles, which
        # read values in key pairs: a copy of V laid out [pages, kv_heads, page_size / 2,
        # head_dim, 2], kept in step by write() and copy_slots(), so no step re-pairs the
        # context. value_pairs: None = where the kernel reads them (kernels.value_pairs_wanted);
        # they add V's bytes again (the pool grows by half).
        self._pairs_all = None
        if value_pairs is None:
            value_pairs = kernels.value_pairs_wanted(dtype, head_dim, page_size, device)
        if value_pairs:
            if page_size % 2 or dtype != torch.bfloat16 or torch.device(device).type != "cpu":
                raise ValueError(f"value pairs need bf16 CPU pages of an even size, got {dtype} pages of "
                                 f"{page_size} on {device}")
            self._pairs_all = torch.zeros(num_layers, num_pages, num_kv_heads, page_size // 2, head_dim, 2,
                                          dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] i64 = page * page_size + offset; k, v [T, kv_heads, head_dim]."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)
        if self._pairs_all is not None:
            kernels.sync_value_pairs(self._v_all, self._pairs_all, slots, self.page_size, layer)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's caches as [num_pages * page_size, kv_heads, head_dim] slot arrays."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move KV entries between slots in every layer (tree compaction); src, dst [N] i64."""
        if self._k_all.device.type == "cpu":  # one kernel call: row copies of the slots that change
            kernels.move_slots(*self.slot_arrays(), src, dst, self.page_size)
            return
        for cache in (self._k_all, self._v_all):
            slots = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [layers, slots, kv_heads, head_dim]
            slots.index_copy_(1, dst, slots.index_select(1, src))
        if self._pairs_all is not None:
            kernels.sync_value_pairs(self._v_all, self._pairs_all, dst, self.page_size)

    def value_pairs(self, layer: int) -> torch.Tensor | None:
        """The layer's value cache in key pairs (see __init__), or None where it keeps none."""
        return None if self._pairs_all is None else self._pairs_all[layer]

    def slot_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(K, V) of every layer as flat slot arrays [L, slots, kv_heads, head_dim] (views), and
        V's key-pair copy or None where the pool keeps none: what a kernel that writes the
        caches and keeps the pairs in step itself takes (kernels.model_step, head_step)."""
        layers, _, _, kv_heads, dim = self._k_all.shape
        return self._k_all.view(layers, -1, kv_heads, dim), self._v_all.view(layers, -1, kv_heads, dim), self._pairs_all

    def sync_value_pairs(self) -> None:
        """Re-derive the pair copy of V from V everywhere: for code that writes self.v
        directly (tests, benchmarks) instead of through write()."""
        if self._pairs_all is not None:
            slots = torch.arange(self.num_pages * self.page_size, device=self._v_all.device)
            kernels.sync_value_pairs(self._v_all, self._pairs_all, slots, self.page_size)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV at the given slots, for tests and debugging: [N, kv_heads, head_dim] each."""
        k, v = self.flat(layer)
        return k.index_select(0, slots), v.index_select(0, slots)

    def nbytes(self) -> int:
        caches = (self._k_all, self._v_all) + ((self._pairs_all,) if self._pairs_all is not None else ())
        return sum(t.numel() * t.element_size() for t in caches)


def slot_mapping(page_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Flat slot ids of positions start..end-1 of a sequence with this page table."""
    return [page_table[p // page_size] * page_size + p % page_size for p in range(start, end)]
