"""The page allocator: owns every KV page id. One page table per sequence, used by the
target's and the draft's pools alike (they are indexed by the same ids)."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: recently freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra_pages(self, table: list[int], num_tokens: int) -> int:
        """Pages a table needs to add to hold num_tokens."""
        return max(0, self.pages_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.extra_pages(table, num_tokens) <= len(self._free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append pages to `table` (in place) until it holds num_tokens."""
        need = self.extra_pages(table, num_tokens)
        if need > len(self._free):
            raise OutOfPages(f"need {need} pages, {len(self._free)} free")
        for _ in range(need):
            table.append(self._free.pop())

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Give back the pages past what num_tokens needs (after rejected drafts)."""
        keep = self.pages_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()
