"""The page allocator: owns every KV page id. One page table per sequence, used by the
target's and the draft's pools alike (they are indexed by the same ids).

With prefix caching (runtime/prefix_cache.py) some pages are shared: a released page the cache
keeps is not free, and when the free list runs out the cache gives back its least recently
used unreferenced page. Without it (`cache` None) pages are simply free or held."""

from __future__ import annotations

from typing import Protocol


class OutOfPages(RuntimeError):
    pass


class PageCache(Protocol):
    num_evictable: int

    def release(self, page: int) -> bool: ...  # True: the cache keeps the page

    def evict(self) -> int: ...


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: recently freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, -1, -1))
        self.cache: PageCache | None = None  # set by PrefixCache

    @property
    def num_free(self) -> int:
        """Pages a sequence can get: free ones, and cached ones nobody holds (evicted on demand)."""
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra_pages(self, table: list[int], num_tokens: int) -> int:
        """Pages a table needs to add to hold num_tokens."""
        return max(0, self.pages_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.extra_pages(table, num_tokens) <= self.num_free

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append pages to `table` (in place) until it holds num_tokens."""
        need = self.extra_pages(table, num_tokens)
        if need > self.num_free:
            raise OutOfPages(f"need {need} pages, {self.num_free} free")
        for _ in range(need):
            # Free pages first: a cached page is evicted only when nothing else is left.
            table.append(self._free.pop() if self._free else self.cache.evict())

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Give back the pages past what num_tokens needs (after rejected drafts)."""
        keep = self.pages_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, table: list[int]) -> None:
        # Last page first: the free list hands out the first page next, and the cache's LRU
        # order gets a chain's leaf before its parent (evicted first).
        for page in reversed(table):
            self._release(page)
        table.clear()

    def _release(self, page: int) -> None:
        if self.cache is None or not self.cache.release(page):
            self._free.append(page)
