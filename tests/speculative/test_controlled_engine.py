"""Speculation under the controller, through the engine: still lossless when every step mixes
chains of different lengths, trees, plain rows and prefill chunks (choices forced at random by
a controller double), and the real controller's choices visible in the stats."""

import pytest
import torch

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from overlap.speculative.controller import ControllerConfig, SpeculationController
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative import test_eagle, test_mtp, test_spec_engine
from speculative.doubles import RandomChoices
from speculative.engine_stats import check_engine_law
from speculative.test_controller import Scripted
from speculative.test_eagle import echo_heads  # noqa: F401 (a fixture)
from speculative.test_spec_engine import N_SAMPLES, T1, prompts

# (method, chain length or tree shape): every drafter, static and dynamic trees.
DRAFTERS = ["draft", "ngram", "mtp", "eagle-static", "eagle-dynamic"]


def build(tiny_dirs, heads, drafter, controller, **kw):
    if drafter == "draft":
        return test_spec_engine.engine(tiny_dirs, "draft", draft="draft", k=4, controller=controller, **kw)
    if drafter == "ngram":
        return test_spec_engine.engine(tiny_dirs, "ngram", k=4, controller=controller, **kw)
    if drafter == "mtp":
        return test_mtp.engine(tiny_dirs, heads, k=3, controller=controller, **_sched(kw))
    return test_eagle.engine(tiny_dirs, heads, tokens=6, tree=drafter.split("-")[1], controller=controller,
                             **_sched(kw))


def _sched(kw):
    return {k: v for k, v in kw.items() if k not in ("max_num_seqs",)}


def record_plans(eng):
    plans = []
    run = eng.executor.execute

    def execute(plan):
        plans.append(plan)
        return run(plan)

    eng.executor.execute = execute
    return plans


def varied_prompts(n, seed):
    """Lengths from 4 to 60 tokens, so later prompts' chunks share steps with earlier decodes."""
    ps = prompts(n, seed)
    return [(p * 4)[: 4 + (7 * i) % 57] for i, p in enumerate(ps)]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_equals_plain_with_mixed_choices_and_prefill_chunks(tiny_dirs, heads, greedy_reference, drafter):
    ps = varied_prompts(8, seed=71)
    ctl = RandomChoices(seed=3)
    # A 40-token budget: prompts arrive in chunks beside running decodes.
    eng = build(tiny_dirs, heads, drafter, ctl, max_batched_tokens=40)
    plans = record_plans(eng)
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    assert ctl.mixed_steps > 0 and ctl.chosen.get(0) and len(ctl.chosen) > 1, ctl.chosen
    with_chunks = [p for p in plans if not p.is_decode_only and any(s.num_spec_tokens for s in p.seqs)]
    assert with_chunks, "no step speculated beside a prefill chunk"
    if drafter != "ngram":  # n-gram may find nothing to draft in a given step
        assert sum(r.stats.get("draft_tokens", 0) for r in results) > 0
    assert eng.stats()["free_pages"] == eng.stats()["total_pages"]


@pytest.mark.parametrize("drafter", ["draft", "mtp", "eagle-static", "eagle-dynamic"])
def test_greedy_equals_plain_with_mixed_choices_and_preemption(tiny_dirs, heads, greedy_reference, drafter):
    ps = varied_prompts(8, seed=11)
    eng = build(tiny_dirs, heads, drafter, RandomChoices(seed=5), page_size=4, num_pages=48, max_batched_tokens=64)
    results = eng.generate(ps, SamplingParams(max_tokens=30, ignore_eos=True))
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == greedy_reference(ps, 30)


def test_chain_sampling_keeps_the_target_distribution_with_mixed_k(tiny_dirs):
    """Every step gives each sequence k in 0..3 at random: chains of different lengths and plain
    rows in one verify pass; drafts are still verified at every depth, and the law holds."""
    eng = test_spec_engine.engine(tiny_dirs, "draft", draft="draft_v6", target="target_v6", k=3,
                                  max_num_seqs=1000, max_batched_tokens=8192, num_pages=4096,
                                  controller=RandomChoices(seed=9, plain_weight=0.2))
    check_engine_law(eng, T1, N_SAMPLES, length=5, depth=3)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_tree_sampling_keeps_the_target_distribution_with_plain_rows_beside(tiny_dirs, echo_heads, tree):
    """Trees and plain decodes share each verify pass (a quarter of the sequences decode plainly
    each step, at random); every depth is verified and the law holds."""
    ctl = RandomChoices(seed=13)
    nodes = test_eagle.TREE_TOKENS[tree]
    eng = test_eagle.engine(tiny_dirs, echo_heads, target="target_v6", depth=3, topk=2,
                            tokens=nodes, max_num_seqs=1000, max_batched_tokens=8192,
                            num_pages=4096, tree=tree, controller=ctl)
    # Room for a tree on the first decode steps: tokens 2.. come from trees, chains or plain steps.
    check_engine_law(eng, T1, 4000, length=5, depth=3, max_tokens=3 * nodes)
    # Static trees: chains of 1-3 drafts along the top path shared the steps with the trees.
    assert set(ctl.chosen) == ({0, 1, 2, 3, nodes} if tree == "static" else {0, nodes}), ctl.chosen


def test_chains_and_trees_share_a_step_and_stay_lossless(tiny_dirs, heads, greedy_reference):
    """EAGLE's fixed shape: a sequence given fewer drafts than the tree's nodes drafts a chain
    along the top path, verified in the same pass as the others' trees."""
    ps = varied_prompts(8, seed=23)
    eng = build(tiny_dirs, heads, "eagle-static", RandomChoices(seed=29, plain_weight=0.1))
    plans = record_plans(eng)
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    nodes = eng.executor.proposer.num_nodes
    both = [p for p in plans if {w.num_spec_tokens for w in p.seqs if w.is_decode} >= {1, nodes}
            or {w.num_spec_tokens for w in p.seqs if w.is_decode} >= {3, nodes}]
    assert both, "no step verified a chain beside a tree"
    assert sum(r.stats.get("draft_tokens", 0) for r in results) > 0


def test_the_real_controller_in_the_engine_shows_its_choices(tiny_dirs, greedy_reference):
    ps = prompts(3, seed=5)
    flat = SpeculationController(Scripted(base=10.0, per_row=0.0, drafter=0.0))
    eng = test_spec_engine.engine(tiny_dirs, "draft", draft="target", k=3, controller=flat)
    results = eng.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 16)
    # The target as its own draft is always right and rows are free: full k throughout.
    for r in results:
        assert set(r.stats["k_histogram"]) <= {"1", "2", "3"} and r.stats["k_histogram"].get("3"), r.stats
    stats = eng.stats()
    assert stats["spec_controller"] == "on" and stats["spec_mean_k"] > 2


def test_a_compute_bound_cost_curve_turns_speculation_off(tiny_dirs, greedy_reference):
    ps = prompts(4, seed=6)
    # Every request admitted attached (a probe), so the controller is asked each step.
    steep = SpeculationController(Scripted(base=1.0, per_row=10.0, drafter=0.1),
                                  ControllerConfig(relax=0.0, probe_every=1))
    eng = test_spec_engine.engine(tiny_dirs, "draft", draft="draft", k=3, controller=steep)
    results = eng.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 16)
    assert all("draft_tokens" not in r.stats for r in results)
    assert all(r.stats["k_histogram"] == {"0": r.stats["k_histogram"]["0"]} for r in results)


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("when", ["after steps", "at admission"])
def test_detached_sequences_stop_being_followed_and_stay_lossless(tiny_dirs, heads, greedy_reference, drafter, when):
    """A compute-bound curve: no drafts ever, and the batch rules them out, so every sequence
    is detached, and from then on its steps carry no drafter work (draft=False); outputs
    unchanged. At admission (the default): the drafter never follows it, not even over its
    prompt. After steps (each request admitted as a probe): after `detach_hopeless` of them."""
    ps = prompts(3, seed=9)
    probe_every = 1 if when == "after steps" else 0
    steep = SpeculationController(Scripted(base=1.0, per_row=10.0, drafter=0.1),
                                  ControllerConfig(relax=0.0, detach_after=16, detach_hopeless=4, probe_every=probe_every))
    eng = build(tiny_dirs, heads, drafter, steep)
    plans = record_plans(eng)
    results = eng.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 16)
    assert eng.stats()["spec_detached"] == len(ps)
    seqs = {w.seq_id for p in plans for w in p.seqs}
    followed = [sum(1 for p in plans for w in p.seqs if w.seq_id == s and w.draft and w.is_decode) for s in seqs]
    if when == "after steps":
        assert followed and all(n == 4 for n in followed), followed  # 4 hopeless plain choices, then detached
    else:
        assert len(followed) == len(ps) and not any(w.draft for p in plans for w in p.seqs)


def test_engine_default_controller_calibrates_and_stays_lossless(tiny_dirs, greedy_reference, tmp_path, monkeypatch):
    """The default configuration: controller on, a start-up calibration (cached in a scratch home)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    ps = prompts(4, seed=8)
    spec = SpecConfig(method="draft", num_spec_tokens=3, draft_model=str(tiny_dirs["draft"]))
    cfg = EngineConfig(model=str(tiny_dirs["target"]), spec=spec, cache=CacheConfig(page_size=16, num_pages=512),
                       scheduler=SchedulerConfig(max_num_seqs=64, max_batched_tokens=512))
    eng = Engine(cfg, progress=False)
    assert list((tmp_path / ".cache" / "overlap" / "step_costs").glob("*.json")), "calibration not cached"
    results = eng.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 16)
    assert eng.stats()["spec_controller"] == "on"
    assert Engine(cfg, progress=False).controller.cost.as_dict()["points"] == eng.controller.cost.as_dict()["points"]
    # The draft model's own step was calibrated beside the target's curve, and cached with it.
    drafter = eng.controller.cost.as_dict()["drafter_points"]
    assert set(drafter) == {"1", "8"} and all(ms > 0 for ms in drafter.values())
    assert Engine(cfg, progress=False).controller.cost.as_dict()["drafter_points"] == drafter


def test_chain_only_steps_expand_just_the_top_path(tiny_dirs, heads, greedy_reference):
    """A step where every drafting sequence takes a chain runs the head on the top path alone
    (one more row per level, as an MTP chain) instead of the whole tree, and drafts the tokens
    the whole tree's expansion has on that path."""
    ps = varied_prompts(2, seed=31)
    eng = build(tiny_dirs, heads, "eagle-static", RandomChoices(seed=37, plain_weight=0.1))
    proposer = eng.executor.proposer
    # The levels in Python, whose head runs this counts (the one-call expansion runs the same
    # levels: tests/models/test_heads.py, test_the_one_call_tree_expansion_equals_the_python_levels).
    proposer.head.expand_tree = lambda *args: None
    expand, run = proposer.propose_tree, proposer._run
    head_rows: list[int] = []  # rows of each head run of the chain expansion being checked
    checked = []

    def propose_tree(seqs, only=None):
        if only is None:
            return expand(seqs)
        whole = expand(seqs)  # the expansion rows are scratch: the chain's run rewrites them
        head_rows.clear()
        tokens = expand(seqs, only)
        cols = [n - 1 for n in sorted(only)]
        assert torch.equal(tokens[:, cols], whole[:, cols])
        checked.append((len(seqs), len(only), list(head_rows)))
        return tokens

    def counting_run(ids, *args):
        head_rows.append(len(ids))
        return run(ids, *args)

    proposer.propose_tree, proposer._run = propose_tree, counting_run
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    assert checked, "no step drafted chains only"
    for seqs, drafts, rows in checked:
        # A chain of c drafts: the head runs at levels 1..c-1, over the top path's nodes so far.
        assert rows == [seqs * level for level in range(1, drafts)], (seqs, drafts, rows)
