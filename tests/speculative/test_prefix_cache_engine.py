"""Prefix caching through the engine, for every drafter (docs/prefix_caching.md).

A cached page carries the KV of every pool (target, draft model, MTP/EAGLE head), so a request
that hits the cache must produce exactly what it produces with the cache off: the same greedy
tokens, and, since its drafter starts from the same KV, the same drafts and acceptances (the
n-gram drafter and a lookup branch, which keep the tokens on the host, are handed the cached
prefix's tokens with the first chunk after the hit: SeqWork.reused_ids). Also: a whole-prompt hit, eviction under a tiny page budget, and the target
distribution under sampling with most requests hitting the cache.
"""

import random

import pytest

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative.engine_stats import PROMPT, check_engine_law
from speculative.test_spec_engine import N_DEEP, T1

METHODS = ["none", "draft", "ngram", "mtp", "eagle"]
MAX_TOKENS = 16


def engine(tiny_dirs, heads, method, prefix_caching, target="target", page_size=4, num_pages=512,
           max_batched_tokens=512, max_num_seqs=64, k=3, lookup_branch=0) -> Engine:
    # controller="off": these tests compare draft counts and depths, which a controller choosing
    # k from measured step times would vary between runs.
    spec = SpecConfig(method=method, num_spec_tokens=4 if method == "eagle" else k, controller="off",
                      draft_model=str(tiny_dirs["draft" if target == "target" else "draft_v6"])
                      if method == "draft" else None,
                      head=str(heads[target]) if method in ("mtp", "eagle") else None,
                      tree_depth=2, tree_topk=2, tree_tokens=4, lookup_branch=lookup_branch, lookup_min_match=1)
    return Engine(EngineConfig(model=str(tiny_dirs[target]), spec=spec,
                               cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                                                 prefix_caching=prefix_caching),
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                         max_batched_tokens=max_batched_tokens)),
                  progress=False)


def shared_prefix_waves(seed=0) -> list[list[list[int]]]:
    """Waves of prompts (each wave runs as one batch, after the one before) behind one system
    prompt of 22 tokens: 5 full pages of 4 and 2 tokens into the sixth."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(10, 49000) for _ in range(n)]  # noqa: E731
    system = tok(22)
    first = system + tok(5)
    return [
        [first],
        [system + tok(3),  # diverges inside page 5
         system[:20] + tok(6),  # diverges right at the page 5 boundary
         system[:13] + tok(4),  # diverges inside page 3
         list(first)],  # the whole prompt was seen
        [list(first), system + tok(9) + system[:8]],  # again; and one that repeats the prefix later
    ]


def run_waves(eng: Engine, waves, continue_first: bool = True) -> list:
    """Each wave as one batch; then the first prompt + its output + more tokens (a chat's next
    turn: its cached pages include generated tokens). (token ids, (drafts, accepted)) each."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    results = []
    for wave in waves:
        results += eng.generate(wave, params)
    if continue_first:
        results += eng.generate([waves[0][0] + results[0].token_ids + [11, 12, 13]], params)
    return [(r.token_ids, (r.stats.get("draft_tokens", 0), r.stats.get("accepted_tokens", 0))) for r in results]


@pytest.fixture(scope="module")
def plain_outputs(tiny_dirs, heads):
    eng = engine(tiny_dirs, heads, "none", prefix_caching=False)
    return [ids for ids, _ in run_waves(eng, shared_prefix_waves())]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_outputs_and_drafts_are_the_same_with_the_cache_on_and_off(tiny_dirs, heads, plain_outputs, method):
    waves = shared_prefix_waves()
    off = run_waves(engine(tiny_dirs, heads, method, prefix_caching=False), waves)
    eng = engine(tiny_dirs, heads, method, prefix_caching=True)
    on = run_waves(eng, waves)
    assert [ids for ids, _ in on] == plain_outputs
    assert [ids for ids, _ in off] == plain_outputs
    stats = eng.stats()
    # Wave 2 alone reuses 20 + 16 (20 without the head's lookahead) + 12 + 24 tokens (the
    # repeated prompt leaves its last page to compute).
    assert stats["prefix_cache_hit_tokens"] >= 72, stats
    assert stats["free_pages"] == stats["total_pages"]
    if method != "none":
        assert sum(d for _, (d, _) in on) > 0
    if method != "none":
        # The cached pages carried the drafter's KV (a model drafter), or the first chunk after
        # the hit handed over the cached tokens (n-gram): it proposes what it did from scratch.
        assert [s for _, s in on] == [s for _, s in off]


@pytest.mark.parametrize("method", ["mtp", "eagle", "draft"])
def test_a_lookup_branch_copies_from_a_cached_prefix(tiny_dirs, heads, plain_outputs, method):
    waves = shared_prefix_waves()
    off = run_waves(engine(tiny_dirs, heads, method, prefix_caching=False, lookup_branch=4), waves)
    eng = engine(tiny_dirs, heads, method, prefix_caching=True, lookup_branch=4)
    on = run_waves(eng, waves)
    assert [ids for ids, _ in on] == [ids for ids, _ in off] == plain_outputs
    assert eng.stats()["prefix_cache_hit_tokens"] >= 72
    assert on == off  # the same branches: its history held the cached prompt tokens too


def test_mtp_no_sync_k1_with_the_cache(tiny_dirs, heads, plain_outputs):
    waves = shared_prefix_waves()
    off = run_waves(engine(tiny_dirs, heads, "mtp", prefix_caching=False, k=1), waves)
    on = run_waves(engine(tiny_dirs, heads, "mtp", prefix_caching=True, k=1), waves)
    assert [ids for ids, _ in on] == plain_outputs
    assert on == off


@pytest.mark.parametrize("method", METHODS)
def test_eviction_under_a_tiny_page_budget_loses_nothing(tiny_dirs, heads, plain_outputs, method):
    """20 pages of 4, just enough for the longest request alone (the chat turn: 46 + 16 tokens
    and the drafts' slack): the waves cannot keep what they cache; pages are evicted (and
    sequences preempted) while requests that hit the cache hold shared pages."""
    eng = engine(tiny_dirs, heads, method, prefix_caching=True, num_pages=20, max_batched_tokens=32)
    out = run_waves(eng, shared_prefix_waves())
    assert [ids for ids, _ in out] == plain_outputs
    stats = eng.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    assert stats["free_pages"] == stats["total_pages"]


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_sampling_keeps_the_target_distribution_with_cache_hits(tiny_dirs, heads, method):
    """The chi-square test of test_spec_engine.py with pages of 2: after one warm-up request,
    every request finds PROMPT's first 2 pages cached and computes only its last token."""
    eng = engine(tiny_dirs, heads, method, prefix_caching=True, target="target_v6", page_size=2,
                 num_pages=16384, max_batched_tokens=8192, max_num_seqs=1000, k=3 if method == "draft" else 1)
    eng.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))
    n = N_DEEP if method == "draft" else 4000
    check_engine_law(eng, T1, n, length=5 if method == "draft" else 3, depth=3 if method == "draft" else 1)
    stats = eng.stats()
    assert stats["prefix_cache_hit_tokens"] >= 4 * n, stats
