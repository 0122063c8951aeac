"""EAGLE trees through the engine: greedy exactness (batch 1/4/16, preemption), the target
distribution under sampling, and the target's and head's KV after tree steps equal to a
from-scratch run over the accepted sequence."""

import pytest
import torch

from helpers import random_head

from overlap.attention import SeqAttention
from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from overlap.kv import slot_mapping
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative.doubles import patch_verifier
from speculative.engine_stats import check_engine_law, exact_law, sample
from speculative.markov import law_rejected
from speculative.test_spec_engine import prompts


def engine(tiny_dirs, heads, target="target", depth=3, topk=2, tokens=6, page_size=16, num_pages=512,
           tree="static", controller=None, lookup_branch=0, **sched):
    spec = SpecConfig(controller="off", method="eagle", head=str(heads[target]), tree_depth=depth, tree_topk=topk, tree_tokens=tokens,
                      tree=tree, lookup_branch=lookup_branch)
    return Engine(EngineConfig(model=str(tiny_dirs[target]), spec=spec,
                               cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                               scheduler=SchedulerConfig(**{"max_num_seqs": 64, "max_batched_tokens": 512,
                                                            **sched})),
                  progress=False, controller=controller)


@pytest.mark.parametrize("batch", [1, 4, pytest.param(16, marks=pytest.mark.slow)])  # 16: in the full suite
@pytest.mark.parametrize("depth,topk,tokens,tree", [(3, 2, 6, "static"), (2, 3, 6, "static"), (3, 2, 6, "dynamic")])
def test_greedy_eagle_equals_plain(tiny_dirs, heads, greedy_reference, batch, depth, topk, tokens, tree):
    ps = prompts(batch, seed=60 + batch)
    eng = engine(tiny_dirs, heads, depth=depth, topk=topk, tokens=tokens, tree=tree)
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    assert sum(r.stats.get("drafts", 0) for r in results) > 0
    assert eng.stats()["free_pages"] == eng.stats()["total_pages"]


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_greedy_eagle_with_preemption(tiny_dirs, echo_heads, greedy_reference, tree):
    ps = prompts(8, seed=71)
    eng = engine(tiny_dirs, echo_heads, page_size=4, num_pages=48, max_batched_tokens=48, tree=tree)
    results = eng.generate(ps, SamplingParams(max_tokens=30, ignore_eos=True))
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == greedy_reference(ps, 30)


def echo_head(target_dir, out):
    """A head that predicts, from H_j, the token the target put after position j (fuse picks
    the hidden state, the layer adds nothing). Tiny random targets soon repeat themselves,
    so this head is often right: it exercises long accepted paths."""
    path = random_head(target_dir, out)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    for name, value in sd.items():
        if "norm" in name:
            sd[name] = torch.ones_like(value)
        elif name == "fuse":
            h = value.shape[0]
            sd[name] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1).to(value.dtype)
        else:
            sd[name] = torch.zeros_like(value)
    save_file(sd, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def echo_heads(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("echo")
    return {"target": echo_head(tiny_dirs["target"], root / "e"),
            "target_v6": echo_head(tiny_dirs["target_v6"], root / "e6")}


def small_vocab_prompts(n):
    return [[(3 * i + j) % 6 for j in range(4 + i)] for i in range(n)]


@pytest.mark.parametrize("batch", [1, 4, pytest.param(16, marks=pytest.mark.slow)])  # 16: in the full suite
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_greedy_eagle_with_long_accepted_paths_equals_plain(tiny_dirs, echo_heads, greedy_reference, batch, tree):
    ps = prompts(batch, seed=80 + batch)
    eng = engine(tiny_dirs, echo_heads, depth=4, topk=2, tokens=8, tree=tree)
    results = eng.generate(ps, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 32)
    stats = [r.stats for r in results]
    assert sum(s.get("accepted_tokens", 0) for s in stats) > 5 * batch  # paths of several nodes
    assert max(max(s.get("accepted_per_position", [0])[1:] or [0]) for s in stats) > 0  # depth >= 2


def test_tree_steps_report_what_their_top_path_accepted(tiny_dirs, echo_heads, greedy_reference):
    """Each tree step tells the controller what the tree's top path (the chain the controller
    could have chosen instead) accepted on its own: at most what the tree accepted, all of it
    where the walk stayed on the top path, less where another branch carried it further."""
    ps = prompts(4, seed=91)
    eng = engine(tiny_dirs, echo_heads, depth=4, topk=2, tokens=8)
    seen = []
    observe = eng.controller.observe

    def spy(key, num_drafts, num_accepted, tree=False, depth=0, branch_rows=None, top_accepted=-1):
        seen.append((num_accepted, tree, top_accepted))
        observe(key, num_drafts, num_accepted, tree, depth, branch_rows, top_accepted)

    eng.controller.observe = spy
    results = eng.generate(ps, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 32)
    trees = [(a, top) for a, tree, top in seen if tree]
    assert trees and all(0 <= top <= a for a, top in trees)
    assert any(top > 0 for _, top in trees) and any(top < a for a, top in trees)
    assert eng.controller.tree_gain_population.steps == len(trees)


@pytest.mark.parametrize("lookup", [0, 4])
def test_grown_trees_report_no_top_path(tiny_dirs, echo_heads, greedy_reference, lookup):
    """EAGLE-2's trees are grown on the host with no top path among their nodes: their steps
    report none (-1), with a lookup branch beside them too, and the controller keeps pricing
    them by the trees' own acceptance."""
    ps = prompts(3, seed=92)
    eng = engine(tiny_dirs, echo_heads, depth=4, topk=2, tokens=8, tree="dynamic", lookup_branch=lookup)
    seen = []
    observe = eng.controller.observe

    def spy(key, num_drafts, num_accepted, tree=False, depth=0, branch_rows=None, top_accepted=-1):
        seen.append((tree, top_accepted))
        observe(key, num_drafts, num_accepted, tree, depth, branch_rows, top_accepted)

    eng.controller.observe = spy
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    trees = [top for tree, top in seen if tree]
    assert trees and all(top == -1 for top in trees)
    assert not eng.controller.tree_gain_population.steps and eng.controller.tree_population.rates


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_target_and_head_kv_after_tree_steps_equal_a_from_scratch_run(tiny_dirs, echo_heads, tree):
    eng = engine(tiny_dirs, echo_heads, page_size=4, tokens=8, depth=4, tree=tree)
    ps = prompts(3, seed=9)
    ids = [eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in ps]
    for _ in range(8):
        eng.step()
    eng.executor.synchronize()
    proposer, model, backend = eng.executor.proposer, eng.model, eng.executor.backend
    accepted_some = False
    for rid in ids:
        seq = eng.scheduler.by_request[rid]
        accepted_some |= eng.requests[rid].state.stats.num_accepted_tokens > 0
        tokens, n = seq.tokens, len(seq.tokens)
        table = list(range(-(-n // 4)))
        kv = model.new_kv_pool(len(table), 4)
        meta = backend.plan([SeqAttention(n - 1, n - 1, table)], 4)
        hidden, _ = model(torch.tensor(tokens[:-1]), torch.arange(n - 1), backend, kv, meta)
        ours = torch.tensor(slot_mapping(seq.pages, 0, n - 1, 4))
        ref = torch.tensor(slot_mapping(table, 0, n - 1, 4))
        for layer in range(model.cfg.num_layers):
            for a, b in zip(eng.executor.kv.gather(layer, ours), kv.gather(layer, ref)):
                assert torch.equal(a, b), f"target KV differs in layer {layer}"
        head_kv = proposer.head.new_kv_pool(len(table), 4)
        proposer.head(torch.tensor(tokens[1:]), hidden, torch.arange(n - 1), backend, head_kv, meta)
        for a, b in zip(proposer.kv.gather(0, ours), head_kv.gather(0, ref)):
            assert torch.equal(a, b), "head KV differs"
    assert accepted_some


T1 = SamplingParams(temperature=1.0)


TREE_TOKENS = {"static": 4, "dynamic": 8}


def stat_engine(tiny_dirs, echo_heads, tree):
    """Depth-3 trees from the echo head (often right, so depth-3 leaves get accepted): the static
    one of 4 nodes (0), (0,0), (0,0,0), (1); a dynamic one of 8 (2 + 4 candidates at depths 1
    and 2 outrank every depth-3 one, so 6 nodes would never reach depth 3). A tree step needs room for every node and the extra token, so requests generate
    nodes + 2 tokens: the first decode step is a tree step, the rest plain."""
    return engine(tiny_dirs, echo_heads, target="target_v6", depth=3, topk=2, tokens=TREE_TOKENS[tree],
                  max_num_seqs=1000, max_batched_tokens=8192, num_pages=4096, tree=tree)


@pytest.mark.parametrize("tree,params", [("static", T1), ("dynamic", T1),
                                         pytest.param("static", SamplingParams(temperature=0.8, top_k=3),
                                                      marks=pytest.mark.slow)])
def test_eagle_sampling_keeps_the_target_distribution(tiny_dirs, echo_heads, tree, params):
    """Tokens 1..5 against their exact law: token 1 from the prefill, 2..4 the tree's path, 5 the
    bonus after a depth-3 leaf (the stats say each depth was verified, and the leaf accepted)."""
    eng = stat_engine(tiny_dirs, echo_heads, tree)
    check_engine_law(eng, params, 4000, length=5, depth=3, max_tokens=TREE_TOKENS[tree] + 2)


@pytest.mark.parametrize("bug", ["no_residual", pytest.param("wrong_row", marks=pytest.mark.slow)])
def test_the_law_test_rejects_a_broken_tree_verifier(tiny_dirs, echo_heads, monkeypatch, bug):
    """Power: the same sample size and test reject a tree walk that keeps testing siblings (and
    draws the extra token) against p instead of the residual, or that reads p for a child's
    accept test from the child's own row."""
    eng = stat_engine(tiny_dirs, echo_heads, "static")
    patch_verifier(monkeypatch, bug)
    tokens, _ = sample(eng, T1, 4000, 5, seed0=1000, max_tokens=6)
    rejected, pvalues = law_rejected(tokens, exact_law(eng, T1, 5))
    assert rejected, pvalues
