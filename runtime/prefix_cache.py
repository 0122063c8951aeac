"""Prefix caching: full KV pages shared by reference count across requests (docs/prefix_caching.md).

A page is cached under a key that names every token its KV depends on: the key of the page
before it (its parent) and its own tokens, plus `lookahead` tokens past its end for drafters
whose KV row j reads token j+1 (the MTP / EAGLE head). Keys are exact, not hashes: a parent is
named by a node id that is never reused, so a page whose parent was evicted can never be
matched again (no collision can hand a request another prompt's KV).

What a cached page carries: the KV of EVERY pool indexed by its id (the target's, the draft
model's, the MTP/EAGLE head's). A sequence publishes a page only once every token its key names
has been computed (`num_computed` past it), and by then each drafter's catch-up over those
tokens is queued on the forward stream ahead of any later step that reads the page. So a
request that hits the cache starts with `num_computed` > 0 and shared pages, and no pool is
refilled. The n-gram drafter has no KV: it drafts from the tokens it has seen since the
request was (re)admitted, which excludes a cached prefix (outputs are unchanged; acceptance
may differ).

Lifetime: a cached page is referenced by every running sequence whose table holds it; at zero
references it stays cached but evictable, least-recently-used first, and only when the free
list is empty (PageAllocator asks this cache for a page). A sequence releases its pages last
page first, so within a chain a child is always older in the LRU order than its parent and
eviction takes leaves first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from overlap.config import HEAD_METHODS, EngineConfig, SpecConfig
from runtime.pages import PageAllocator

ROOT = 0  # the parent node id of a sequence's first page


def drafter_lookahead(spec: SpecConfig) -> int:
    """Tokens past a page's end that its KV depends on: the MTP/EAGLE head's row j is built
    from the target's hidden state at j AND token j+1, so with those drafters a page's last
    row belongs to the token after it, and two prompts that diverge right at a page boundary
    must not share the page."""
    return 1 if spec.method in HEAD_METHODS else 0


def build_prefix_cache(config: EngineConfig, allocator: PageAllocator) -> "PrefixCache | None":
    """The prefix cache over `allocator`, or None when config.cache.prefix_caching is off."""
    if not config.cache.prefix_caching:
        return None
    return PrefixCache(allocator, drafter_lookahead(config.spec))


@dataclass
class CachedPage:
    page: int
    node_id: int  # never reused: children are keyed by it
    key: tuple[int, tuple[int, ...]]  # (parent node id, the tokens the KV depends on)
    refs: int = 0  # running sequences whose page table holds it


@dataclass
class CacheChain:
    """How far one sequence's page table is in the cache: its first `num_pages` pages are
    keyed (shared, or published by it), the last of them under node `parent`."""

    num_pages: int = 0
    parent: int = ROOT


class PrefixCache:
    def __init__(self, allocator: PageAllocator, lookahead: int = 0):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.lookahead = lookahead
        self._by_key: dict[tuple[int, tuple[int, ...]], CachedPage] = {}
        self._by_page: dict[int, CachedPage] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced pages, oldest first
        self._node_ids = 1
        # Hit-rate counters, over sequences admitted (a sequence back after preemption counts again).
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        allocator.cache = self  # the allocator takes evictable pages when its free list runs out

    def _key(self, parent: int, tokens: list[int], index: int) -> tuple[int, tuple[int, ...]]:
        start = index * self.page_size
        return parent, tuple(tokens[start: start + self.page_size + self.lookahead])

    # -- admission: reuse a cached prefix --------------------------------------------------

    def match(self, tokens: list[int]) -> tuple[list[int], CacheChain]:
        """The cached pages that hold a prefix of `tokens`, and the chain they form. At least
        the last token is left out: the step that follows must compute something to sample."""
        most = min(len(tokens) - 1, len(tokens) - self.lookahead) // self.page_size
        pages, chain = [], CacheChain()
        for i in range(max(0, most)):
            entry = self._by_key.get(self._key(chain.parent, tokens, i))
            if entry is None:
                break
            pages.append(entry.page)
            chain = CacheChain(i + 1, entry.node_id)
        return pages, chain

    def acquire(self, pages: list[int]) -> None:
        """A sequence takes these cached pages into its table."""
        for page in pages:
            entry = self._by_page[page]
            entry.refs += 1
            self._evictable.pop(page, None)

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit

    # -- while running: publish pages whose every pool's KV is complete --------------------

    def publish(self, tokens: list[int], pages: list[int], num_computed: int, chain: CacheChain) -> None:
        """Key the sequence's pages that are full and whose key's tokens all have KV."""
        while (chain.num_pages + 1) * self.page_size + self.lookahead <= num_computed:
            i = chain.num_pages
            key = self._key(chain.parent, tokens, i)
            entry = self._by_key.get(key)
            if entry is None:
                entry = CachedPage(pages[i], self._node_ids, key, refs=1)  # this sequence holds it
                self._node_ids += 1
                self._by_key[key] = entry
                self._by_page[entry.page] = entry
            # else: another sequence computed the same page at the same time; ours stays private
            # (freed when the sequence ends) and the chain continues from the cached copy.
            chain.num_pages, chain.parent = i + 1, entry.node_id

    # -- the allocator's side: releases and eviction ---------------------------------------

    def release(self, page: int) -> bool:
        """A sequence lets go of `page`; True if the cache keeps it (then it is not free)."""
        entry = self._by_page.get(page)
        if entry is None:
            return False
        entry.refs -= 1
        if entry.refs == 0:
            self._evictable[page] = None  # most recently used end
        return True

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evict(self) -> int:
        """Drop the least recently used unreferenced page from the cache; its id is free again."""
        page, _ = self._evictable.popitem(last=False)
        entry = self._by_page.pop(page)
        del self._by_key[entry.key]
        self.evictions += 1
        return page

    def stats(self) -> dict:
        return {
            "prefix_cache_queried_tokens": self.queried_tokens,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
            "prefix_cache_pages": len(self._by_page),
            "prefix_cache_evictions": self.evictions,
        }
