"""A lookup branch beside a model drafter's drafts (overlap/speculative/lookup_branch.py):
greedy exactness for MTP chains (k = 1 no-sync and k = 3), EAGLE trees (static, dynamic) and
the draft model's chains at several batch and page sizes, under preemption and chunked
prefill, near max_tokens; more tokens accepted where the text repeats; the draft model's KV
re-run after a step that followed the branch; the target distribution kept under sampling
(chi-square) with branches verified in the checked steps; clear errors for drafters without
a model."""

import pytest

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from overlap.speculative.build import build_proposer
from overlap.batch import BatchPlan, SeqOutput, SeqWork
from overlap.speculative.base import DraftLayout, FinishedStep
from overlap.speculative.lookup_branch import BranchedLayout, LookupBranch
from overlap.speculative.ngram import lookup
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative.doubles import RandomChoices, patch_verifier
from speculative.engine_stats import check_engine_law, exact_law, sample
from speculative.markov import law_rejected
from speculative.test_spec_engine import prompts

# (method, k or tree, ...): the model drafters a branch rides with
MODES = {"mtp1": dict(method="mtp", num_spec_tokens=1),
         "mtp3": dict(method="mtp", num_spec_tokens=3),
         "eagle": dict(method="eagle", tree_depth=3, tree_topk=2, tree_tokens=6),
         "eagle-dynamic": dict(method="eagle", tree="dynamic", tree_depth=3, tree_topk=2, tree_tokens=6),
         "draft3": dict(method="draft", num_spec_tokens=3)}
DRAFTS = {"target": "draft", "target_v6": "draft_v6"}  # the tiny draft model of each tiny target


def engine(tiny_dirs, heads, mode, lookup=4, target="target", page_size=16, num_pages=512, min_match=1,
           draft=None, **sched):
    # 1-token matches by default here: branches on the most steps (the shipped default, 2, in
    # its own test). draft: the draft model's directory name in tiny_dirs (default: the target's
    # own tiny draft).
    mode_spec = MODES[mode]
    drafter = ({"draft_model": str(tiny_dirs[draft or DRAFTS[target]]), "drafter_weights": "bf16"}
               if mode_spec["method"] == "draft" else {"head": str(heads[target])})
    spec = SpecConfig(controller="off", lookup_branch=lookup, lookup_min_match=min_match, **drafter, **mode_spec)
    return Engine(EngineConfig(model=str(tiny_dirs[target]), spec=spec,
                               cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                               scheduler=SchedulerConfig(**{"max_num_seqs": 64, "max_batched_tokens": 512,
                                                            **sched})),
                  progress=False)


def count_branches(eng) -> list[int]:
    """Records, per planned step, the branch rows it verifies (0: the head's step unchanged)."""
    proposer = eng.executor.proposer
    assert isinstance(proposer, LookupBranch)
    rows, plan = [], proposer.plan

    def counting(batch, sampled, ks, wait):
        layout = plan(batch, sampled, ks, wait)
        rows.append(sum(layout.num_drafts) - sum(layout.inner.num_drafts)
                    if isinstance(layout, BranchedLayout) else 0)
        return layout
    proposer.plan = counting
    return rows


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch,page_size", [(1, 16), (4, 4), pytest.param(16, 16, marks=pytest.mark.slow)])
def test_greedy_with_a_lookup_branch_equals_plain(tiny_dirs, heads, greedy_reference, mode, batch, page_size):
    ps = prompts(batch, seed=120 + batch)
    eng = engine(tiny_dirs, heads, mode, page_size=page_size, num_pages=2048 // page_size)
    branches = count_branches(eng)
    results = eng.generate(ps, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 32)
    assert sum(branches) > 0, "no step verified a branch"
    assert eng.stats()["free_pages"] == eng.stats()["total_pages"]


@pytest.mark.parametrize("mode", ["mtp3", "eagle", "draft3"])
def test_greedy_with_the_default_match_length_equals_plain(tiny_dirs, heads, greedy_reference, mode):
    """SpecConfig's default: a branch only after a match of 2+ tokens (fewer, longer copies)."""
    ps = [p * 2 for p in prompts(4, seed=141)]
    eng = engine(tiny_dirs, heads, mode, lookup=6, min_match=SpecConfig().lookup_min_match)
    assert eng.executor.proposer.n_min == 2
    branches = count_branches(eng)
    results = eng.generate(ps, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 40)
    assert sum(branches) > 0


@pytest.mark.parametrize("mode", ["mtp3", "eagle"])
def test_the_drafter_verifies_the_branch_the_scheduler_looked_up(tiny_dirs, heads, greedy_reference, mode):
    """The scheduler looks each branch up before its controller chooses (SeqWork.branch): on
    every drafting step it is what the drafter's own lookup on its history finds, and a
    scheduler that does not look up leaves the lookup to the drafter, with the same outputs."""
    ps = [p * 2 for p in prompts(4, seed=150)]
    eng = engine(tiny_dirs, heads, mode)
    proposer, plan, seen = eng.executor.proposer, eng.executor.proposer.plan, []

    def checking(batch, sampled, ks, wait):
        for s, k in zip(sampled, ks):
            if k and s.lookup_rows:
                own = lookup(proposer.history.get(s.seq_id, []), min(proposer.length, s.lookup_rows),
                             proposer.n_min, proposer.n_max)
                seen.append((s.branch, own))
        return plan(batch, sampled, ks, wait)
    proposer.plan = checking
    results = eng.generate(ps, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 32)
    assert sum(1 for branch, _ in seen if branch) > 0, "no step found a branch"
    assert all(branch == own for branch, own in seen)
    unlooked = engine(tiny_dirs, heads, mode)
    unlooked.scheduler._lookup = lambda work: None
    branches = count_branches(unlooked)
    results = unlooked.generate(ps, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 32)
    assert sum(branches) > 0


@pytest.mark.parametrize("mode", ["mtp3", "eagle", "draft3"])
def test_greedy_with_branches_cut_by_the_controller_equals_plain(tiny_dirs, heads, greedy_reference, mode):
    """The controller may verify a known branch's first rows only (branch_cap): with a
    controller that cuts at random (1, 3 or all of the 4 rows) and mixes its options, outputs
    stay the target's."""
    ps = [p * 2 for p in prompts(4, seed=152)]
    eng = engine(tiny_dirs, heads, mode)
    eng.scheduler.controller = RandomChoices(seed=17, plain_weight=0.1)
    plan, lengths = eng.executor.proposer.plan, set()

    def recording(batch, sampled, ks, wait):
        lengths.update(len(s.branch) for s, k in zip(sampled, ks) if k and s.branch)
        return plan(batch, sampled, ks, wait)
    eng.executor.proposer.plan = recording
    results = eng.generate(ps, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 32)
    assert {1, 3, 4} <= lengths


@pytest.mark.parametrize("mode", ["mtp1", "mtp3", "eagle", "draft3"])
def test_greedy_with_a_lookup_branch_under_preemption_and_chunked_prefill(tiny_dirs, heads, greedy_reference, mode):
    ps = [p * 3 for p in prompts(8, seed=131)]  # several prefill chunks each
    eng = engine(tiny_dirs, heads, mode, page_size=4, num_pages=48, max_batched_tokens=32)
    branches = count_branches(eng)
    results = eng.generate(ps, SamplingParams(max_tokens=30, ignore_eos=True))
    assert eng.scheduler.num_preemptions > 0
    assert sum(branches) > 0
    assert [r.token_ids for r in results] == greedy_reference(ps, 30)


def test_a_branch_never_runs_past_max_tokens(tiny_dirs, heads, greedy_reference):
    """The scheduler reserves branch rows within the room left (a step emits at most its
    accepted rows + 1): long branches on repetitive prompts stop at max_tokens exactly, and
    steps near the end verify branches cut to the room (over the three lengths: a run whose
    last branch jumps from a full room to the end cuts none)."""
    ps = [[7, 8, 9] * 6, [5, 6] * 9, [11] * 12, prompts(1, seed=3)[0] * 2]
    reserved = []
    for max_tokens in (9, 12, 17):
        eng = engine(tiny_dirs, heads, "mtp3", lookup=6)
        branches = count_branches(eng)
        plan = eng.executor.proposer.plan

        def recording(batch, sampled, ks, wait, plan=plan):
            reserved.extend(s.lookup_rows for s, k in zip(sampled, ks) if k)
            return plan(batch, sampled, ks, wait)
        eng.executor.proposer.plan = recording
        results = eng.generate(ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        assert [r.token_ids for r in results] == greedy_reference(ps, max_tokens)
        assert all(len(r.token_ids) == max_tokens for r in results)
        assert sum(branches) > 0
        assert eng.stats()["free_pages"] == eng.stats()["total_pages"]
    assert 6 in reserved and min(reserved) < 6, reserved  # full rows early, cut ones near the end


@pytest.mark.parametrize("mode", ["mtp3", "draft3"])
def test_the_branch_accepts_more_where_the_text_repeats(tiny_dirs, heads, greedy_reference, mode):
    """The random head (the random draft) is rarely right; the tiny target repeats itself, and
    the copy is: the same requests accept more tokens a step with the branch than without."""
    ps = [[7, 8, 9, 10] * 5, [21, 22] * 8, prompts(1, seed=3)[0] * 2]
    accepted = {}
    for lookup in (0, 4):
        eng = engine(tiny_dirs, heads, mode, lookup=lookup)
        results = eng.generate(ps, SamplingParams(max_tokens=40, ignore_eos=True))
        assert [r.token_ids for r in results] == greedy_reference(ps, 40)
        accepted[lookup] = sum(r.stats.get("accepted_tokens", 0) for r in results)
    assert accepted[4] > accepted[0] + 10, accepted


@pytest.mark.parametrize("mode", ["mtp1", "mtp3", "eagle", "draft3"])
def test_sampling_with_a_lookup_branch_keeps_the_target_distribution(tiny_dirs, heads, mode):
    """The first 5 tokens against their exact law (vocab 6: the prompt's own tokens recur, so
    the first decode steps verify branches; the counter says they did)."""
    eng = engine(tiny_dirs, heads, mode, lookup=3, target="target_v6", max_num_seqs=1000,
                 max_batched_tokens=8192, num_pages=4096)
    branches = count_branches(eng)
    check_engine_law(eng, SamplingParams(temperature=1.0), 4000, length=5, depth=0)
    assert sum(branches) > 1000, sum(branches)


def test_the_law_test_rejects_a_broken_verifier_of_branched_steps(tiny_dirs, heads, monkeypatch):
    """Power: the same sample size and test reject branched MTP steps verified with a tree walk
    that tests the head's children against p instead of the residual once the branch failed."""
    eng = engine(tiny_dirs, heads, "mtp3", lookup=3, target="target_v6", max_num_seqs=1000,
                 max_batched_tokens=8192, num_pages=4096)
    patch_verifier(monkeypatch, "no_residual")
    params = SamplingParams(temperature=1.0)
    tokens, _ = sample(eng, params, 4000, 5, seed0=1000)
    rejected, pvalues = law_rejected(tokens, exact_law(eng, params, 5))
    assert rejected, pvalues


def test_the_draft_model_re_runs_what_the_branch_produced(tiny_dirs, heads, greedy_reference):
    """The target as its own draft (bf16: q = p) drafts exactly what the target decodes, as
    long as its KV holds the sequence: its first draft is the target's next token, so every
    speculative step accepts at least one draft. A step whose walk followed the branch leaves
    the draft's chain, not the copy, at those positions in the draft's KV: unless its catch-up
    re-runs the produced tokens, its next drafts read the wrong KV and miss."""
    ps = [[7, 8, 9, 10] * 5, [21, 22] * 8, prompts(1, seed=3)[0] * 2, prompts(1, seed=4)[0] * 3]
    eng = engine(tiny_dirs, heads, "draft3", lookup=4, draft="target")
    steps, observe = [], eng.executor.proposer.observe

    def recording(finished):
        steps.extend((out.num_drafts, out.num_accepted, out.token_ids) for s, out, _ in finished.followed()
                     if out.num_drafts)
        observe(finished)
    eng.executor.proposer.observe = recording
    results = eng.generate(ps, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 40)
    followed_branch = [a for d, a, _ in steps if d > 3]  # deeper than the chain: the branch's path
    assert any(a > 3 for a in followed_branch), "no step accepted more than the chain could"
    missed = [step for step in steps if step[1] == 0]
    assert not missed, f"{len(missed)} of {len(steps)} steps accepted no draft: {missed[:5]}"


class _RecordingChain:
    """A stand-in draft proposer: a chain of k drafts, and the outputs its catch-up is shown."""

    name, state_on_host, trusts_own_drafts = "chain", False, True

    def __init__(self, k: int):
        self.k, self.seen = k, []

    def plan(self, batch, sampled, ks, wait):
        return DraftLayout.chains([self.k if k else 0 for k in ks])

    def catch_up(self, finished):
        self.seen.append([(o.num_drafts, o.num_accepted) for o in finished.outputs])

    def release(self, seq_ids):
        pass


@pytest.mark.parametrize("produced,accepted,seen", [
    ([8, 9, 6, 3], 3, (2, 0)),   # the walk took the branch (8 9 6): no draft of the chain counts
    ([5, 1], 1, (2, 1)),         # the chain's first draft (5, not the branch's 8): as the chain saw it
    ([8, 2], 1, (2, 0)),         # the branch's first token: the walk may have taken either, re-run
    ([4], 0, (2, 0)),            # nothing accepted
])
def test_the_draft_hears_whether_the_walk_may_have_followed_the_branch(produced, accepted, seen):
    """LookupBranch tells a drafter that trusts its own drafts' KV (the draft model) how many of
    ITS drafts a branched step accepted: its chain's k, and none where the produced tokens
    start with the branch's first token (module doc); a sequence without a branch and an
    unbranched step pass through unchanged."""
    inner = _RecordingChain(k=2)
    branch = LookupBranch(inner, length=4, n_min=1, n_max=3)
    branch.history = {0: [7, 8, 9, 6, 7], 1: [1, 2, 3]}  # seq 0: "7" was followed by 8 9 6 7; seq 1: no match
    seqs = [SeqWork(0, [7], 4, [0], True, num_spec_tokens=2, draft=True, lookup_rows=4),
            SeqWork(1, [3], 2, [1], True, num_spec_tokens=2, draft=True, lookup_rows=4)]
    layout = branch.plan(BatchPlan(1, seqs), seqs, [2, 2], lambda: None)
    assert isinstance(layout, BranchedLayout) and layout.tokens == [[-1, -1, 8, 9, 6, 7], [-1, -1]]
    outputs = [SeqOutput(0, produced, max(layout.depths[0]), accepted), SeqOutput(1, [5, 6], 2, 1)]
    branch.catch_up(FinishedStep(seqs, outputs, [0, 1 + 6]))
    assert inner.seen == [[seen, (2, 1)]]
    assert branch.branched == {}  # read once, at the step's catch-up


@pytest.mark.parametrize("method", ["ngram", "none"])
def test_a_branch_needs_a_model_drafter(tiny_dirs, method):
    spec = SpecConfig(method=method, lookup_branch=4)
    eng_config = EngineConfig(model=str(tiny_dirs["target"]), spec=spec)
    with pytest.raises(ValueError, match="lookup_branch 4: a lookup branch is verified beside a model drafter"):
        build_proposer(eng_config, None)


@pytest.mark.parametrize("method,ngram", [("ngram", (0, 3)), ("mtp", (0, 3)), ("ngram", (3, 2))])
def test_lookups_need_a_suffix_of_at_least_one_token(tiny_dirs, method, ngram):
    """ngram_min 0 would match the empty suffix one token back: every lookup a copy of the
    last token, repeated to the length asked for."""
    spec = SpecConfig(method=method, ngram_min=ngram[0], ngram_max=ngram[1])
    with pytest.raises(ValueError, match="lookups match 1 <= ngram_min <= ngram_max tokens"):
        build_proposer(EngineConfig(model=str(tiny_dirs["target"]), spec=spec), None)
