"""The prefix cache and its scheduler hooks, without a model: what is published, matched,
shared, kept and evicted (runtime/prefix_cache.py). Outputs through real models:
tests/speculative/test_prefix_cache_engine.py."""

from overlap.batch import SeqOutput, StepOutput
from overlap.config import SchedulerConfig
from runtime.messages import SamplingParams
from runtime.pages import PageAllocator
from runtime.prefix_cache import PrefixCache
from runtime.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)


def scheduler(num_pages=64, page_size=4, lookahead=0, **kw) -> Scheduler:
    allocator = PageAllocator(num_pages, page_size)
    return Scheduler(SchedulerConfig(**kw), allocator, eos_token_ids=(2,),
                     prefix_cache=PrefixCache(allocator, lookahead))


def run_to_end(s: Scheduler, token=7) -> list:
    """Step until every request ended, every sampling sequence producing `token`; the plans."""
    plans = []
    while s.has_work():
        plan = s.schedule()
        s.update(plan, StepOutput(plan.step_id, [SeqOutput(w.seq_id, [token] if w.sample else [])
                                                 for w in plan.seqs]))
        plans.append(plan)
    return plans


def first_work(plans, seq_id):
    return next(w for p in plans for w in p.seqs if w.seq_id == seq_id)


def test_a_later_request_starts_after_the_shared_full_pages_and_reuses_them():
    s = scheduler()
    system = list(range(100, 110))  # 2 full pages of 4 and 2 tokens into the third
    a = s.add("a", system + [1, 2], GREEDY, seed=0)
    plans = run_to_end(s)
    a_pages = first_work(plans, a.seq_id).page_table
    b = s.add("b", system + [3, 4, 5], GREEDY, seed=0)  # diverges inside page 2
    plans = run_to_end(s)
    w = first_work(plans, b.seq_id)
    assert w.start_pos == 8 and w.token_ids == system[8:] + [3, 4, 5]
    assert w.page_table[:2] == a_pages[:2] and w.page_table[2] != a_pages[2]
    stats = s.stats()
    assert stats["prefix_cache_hit_tokens"] == 8
    assert stats["prefix_cache_queried_tokens"] == 12 + 13
    assert stats["free_pages"] == stats["total_pages"]  # cached pages nobody holds count as free


def test_a_whole_prompt_hit_still_computes_its_last_token_and_does_not_speculate_first():
    s = scheduler()
    prompt = list(range(100, 108))  # exactly 2 pages
    s.add("a", prompt, GREEDY, seed=0)
    run_to_end(s)
    b = s.add("b", prompt, GREEDY, seed=0, num_spec_tokens=3)
    plans = run_to_end(s)
    w = first_work(plans, b.seq_id)
    # The last page is left out (the step needs a token to sample from): 4 tokens recomputed.
    assert (w.start_pos, w.token_ids, w.sample, w.num_spec_tokens) == (4, prompt[4:], True, 0)
    c = s.add("c", prompt + [7], GREEDY, seed=0, num_spec_tokens=3)  # a, b produced 7 after it
    plans = run_to_end(s)
    w = first_work(plans, c.seq_id)
    # One token left: it looks like a decode, but the drafter has not seen this sequence yet.
    assert (w.start_pos, w.token_ids, w.num_spec_tokens) == (8, [7], 0)
    assert [x.num_spec_tokens for p in plans for x in p.seqs][1] > 0  # it speculates from then on


def test_a_page_is_published_only_once_its_key_tokens_are_computed():
    s = scheduler(lookahead=1, max_batched_tokens=4)
    prompt = list(range(100, 112))
    a = s.add("a", prompt, SamplingParams(max_tokens=10, ignore_eos=True), seed=0)
    cache = s.prefix_cache
    s.update(plan := s.schedule(), StepOutput(plan.step_id, [SeqOutput(a.seq_id, [])]))  # 4 computed
    assert cache.stats()["prefix_cache_pages"] == 0  # page 0's head rows wait for token 4
    s.update(plan := s.schedule(), StepOutput(plan.step_id, [SeqOutput(a.seq_id, [])]))  # 8 computed
    assert cache.stats()["prefix_cache_pages"] == 1


def test_lookahead_keeps_prompts_that_part_at_a_page_boundary_apart():
    for lookahead, hit in ((0, 4), (1, 0)):
        s = scheduler(lookahead=lookahead)
        s.add("a", [5, 6, 7, 8, 9, 9], GREEDY, seed=0)
        run_to_end(s)
        s.add("b", [5, 6, 7, 8, 1, 1], GREEDY, seed=0)  # same first page, the next token differs
        run_to_end(s)
        assert s.stats()["prefix_cache_hit_tokens"] == hit, lookahead


def test_eviction_is_least_recently_used_and_only_when_nothing_is_free():
    s = scheduler(num_pages=6, page_size=4)
    s.add("a", [1] * 8 + [9], GREEDY, seed=0)  # 2 cacheable pages
    run_to_end(s)
    s.add("b", [2] * 8 + [9], GREEDY, seed=0)
    run_to_end(s)
    cache = s.prefix_cache
    assert cache.stats()["prefix_cache_pages"] == 4 and cache.evictions == 0
    s.add("a2", [1] * 8 + [9], GREEDY, seed=0)  # touches a's pages: b's are now the oldest
    run_to_end(s)
    s.add("c", [3] * 12, GREEDY, seed=0)  # 4 pages: 2 free + 2 evicted (b's)
    run_to_end(s)
    assert cache.evictions >= 2
    s.add("a3", [1] * 8 + [9], GREEDY, seed=0)
    s.add("b2", [2] * 8 + [9], GREEDY, seed=1)
    run_to_end(s)
    assert cache.hit_tokens == 8 + 8  # a2 and a3 hit a's pages; b2 found b's evicted
    assert s.stats()["free_pages"] == 6


def test_a_page_in_use_is_never_evicted_and_preemption_frees_nothing_shared():
    s = scheduler(num_pages=5, page_size=4, max_batched_tokens=64)
    system = [1] * 8
    s.add("a", system + [9], GREEDY, seed=0)
    run_to_end(s)
    long = SamplingParams(max_tokens=12, ignore_eos=True)
    s.add("b", system + [3], long, seed=0)
    s.add("c", system + [4], long, seed=1)
    while s.has_work():
        plan = s.schedule()
        tables = [w.page_table for w in plan.seqs]
        private = [p for t in tables for p in t[2:]]
        assert len(private) == len(set(private)), "two sequences share a private page"
        s.update(plan, StepOutput(plan.step_id, [SeqOutput(w.seq_id, [7] if w.sample else []) for w in plan.seqs]))
    assert s.num_preemptions > 0
    assert s.stats()["free_pages"] == 5


def test_a_concurrent_duplicate_page_stays_private_and_is_freed():
    s = scheduler(num_pages=16)
    s.add("a", [1] * 9, GREEDY, seed=0)
    s.add("b", [1] * 9, GREEDY, seed=1)  # admitted together: both compute the same pages
    run_to_end(s)
    assert s.prefix_cache.stats()["prefix_cache_pages"] == 2
    assert s.stats()["free_pages"] == 16
