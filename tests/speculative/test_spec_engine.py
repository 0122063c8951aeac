"""Speculative decoding through the engine: greedy exactness for every drafter, the draft's
KV after rejections, and the target distribution kept under sampling (chi-square)."""

import random

import pytest
import torch

from helpers import dense_forward
from overlap.attention import SeqAttention
from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from overlap.kv import slot_mapping
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative.doubles import patch_verifier
from speculative.engine_stats import check_engine_law, exact_law, sample
from speculative.markov import law_rejected


def engine(tiny_dirs, method="none", draft="draft", target="target", k=3, page_size=16,
           num_pages=512, max_num_seqs=64, max_batched_tokens=512, controller=None) -> Engine:
    # The target as its own draft keeps its bf16 weights: q = p exactly, so every greedy draft
    # is accepted (int8 drafter weights, the CPU default, would round it apart).
    spec = SpecConfig(controller="off", method=method, num_spec_tokens=k,
                      draft_model=str(tiny_dirs[draft]) if method == "draft" else None,
                      drafter_weights="bf16" if draft in ("target", "target_v6") else "auto")
    return Engine(EngineConfig(model=str(tiny_dirs[target]), spec=spec,
                               cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                         max_batched_tokens=max_batched_tokens)),
                  progress=False, controller=controller)


def prompts(n, seed):
    rng = random.Random(seed)
    # Repeated phrases give the n-gram drafter something to find.
    out = []
    for _ in range(n):
        base = [rng.randrange(10, 49000) for _ in range(rng.randint(2, 6))]
        out.append((base * rng.randint(2, 6))[: rng.randint(4, 40)])
    return out


@pytest.mark.parametrize("method,draft", [("draft", "draft"), ("draft", "target"), ("ngram", None)])
@pytest.mark.parametrize("batch", [1, 4, pytest.param(16, marks=pytest.mark.slow)])  # 16: in the full suite
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_speculative_equals_plain(tiny_dirs, greedy_reference, method, draft, batch, page_size):
    ps = prompts(batch, seed=batch)
    eng = engine(tiny_dirs, method, draft=draft, page_size=page_size, num_pages=2048 // page_size)
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    drafted = sum(r.stats.get("draft_tokens", 0) for r in results)
    accepted = sum(r.stats.get("accepted_tokens", 0) for r in results)
    assert drafted > 0
    if draft == "target":  # the target as its own draft: every greedy draft is accepted
        assert accepted == drafted
    assert eng.stats()["free_pages"] == eng.stats()["total_pages"]


@pytest.mark.parametrize("method,draft", [("draft", "draft"), ("draft", "target"), ("ngram", None)])
def test_greedy_speculative_with_preemption(tiny_dirs, greedy_reference, method, draft):
    ps = prompts(8, seed=11)
    eng = engine(tiny_dirs, method, draft=draft, page_size=4, num_pages=40, max_batched_tokens=64)
    results = eng.generate(ps, SamplingParams(max_tokens=30, ignore_eos=True))
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == greedy_reference(ps, 30)


def test_per_request_spec_switch_and_k(tiny_dirs, greedy_reference):
    ps = prompts(3, seed=5)
    eng = engine(tiny_dirs, "draft", draft="target", k=2)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, spec=False),
              SamplingParams(max_tokens=16, ignore_eos=True, num_spec_tokens=5),
              SamplingParams(max_tokens=16, ignore_eos=True)]
    results = eng.generate(ps, params)
    assert [r.token_ids for r in results] == greedy_reference(ps, 16)
    assert "draft_tokens" not in results[0].stats
    assert len(results[1].stats["drafted_per_position"]) == 5
    assert len(results[2].stats["drafted_per_position"]) == 2


def test_draft_kv_equals_running_draft_from_scratch(tiny_dirs):
    eng = engine(tiny_dirs, "draft", draft="draft", k=4, page_size=4)
    ps = prompts(3, seed=7)
    ids = [eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in ps]
    for _ in range(6):
        eng.step()
    eng.executor.synchronize()  # the last step's draft catch-up may still be running
    proposer = eng.executor.proposer
    rejected_somewhere = False
    for rid in ids:
        seq = eng.scheduler.by_request[rid]
        rejected_somewhere |= eng.requests[rid].state.stats.num_accepted_tokens < eng.requests[rid].state.stats.num_draft_tokens
        tokens = seq.tokens
        # Fresh pool, same model: run the draft over the accepted sequence in one prefill.
        fresh = proposer.draft.model.new_kv_pool(64, 4)
        backend = eng.executor.backend  # the engine's own kernels: KV must match bit for bit
        table = list(range(-(-len(tokens) // 4)))
        meta = backend.plan([SeqAttention(len(tokens), len(tokens), table)], 4)
        proposer.draft.model(torch.tensor(tokens), torch.arange(len(tokens)), backend, fresh, meta)
        ours = torch.tensor(slot_mapping(seq.pages, 0, len(tokens), 4))
        ref = torch.tensor(slot_mapping(table, 0, len(tokens), 4))
        for layer in range(proposer.draft.model.cfg.num_layers):
            for a, b in zip(proposer.kv.gather(layer, ours), fresh.gather(layer, ref)):
                assert torch.equal(a, b), f"draft KV differs in layer {layer}"
        # The carried logits are the draft's distribution after the last token.
        _, logits = dense_forward(proposer.draft.model, tokens)
        hidden, _ = proposer.draft.model(torch.tensor(tokens), torch.arange(len(tokens)), backend, fresh, meta)
        torch.testing.assert_close(proposer.carried[seq.seq_id], proposer.draft.logits(hidden[-1:])[0])
    assert rejected_somewhere


# ---------------------------------------------------------------------------- distribution
# The first k+2 generated tokens (the prefill's, k drafts, the bonus after the k-th) against their
# exact law, on the vocab-6 tiny models (speculative/engine_stats.py); alpha = markov.ALPHA per test.

# Power (noncentral chi-square at the observed statistics, alpha 1e-3 with Bonferroni): 4000
# samples detect the broken verifiers below at every depth with power ~1; a bug at depth 3 only
# (509 of 4000 requests reject there) needs 12000 for power >= 0.99, which the main case uses.
N_SAMPLES, N_DEEP = 4000, 12000
T1, T07_TOP4 = SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)


def stat_engine(tiny_dirs, method, draft=None, k=3) -> Engine:
    return engine(tiny_dirs, method, draft=draft, target="target_v6", k=k, max_num_seqs=1000,
                  max_batched_tokens=8192, num_pages=4096)


@pytest.mark.parametrize("method,draft,params,n", [
    ("draft", "draft_v6", T1, N_DEEP),  # a full q different from p
    ("ngram", None, T1, N_SAMPLES),  # one-hot q (deterministic drafts)
    pytest.param("draft", "target_v6", T1, N_SAMPLES, marks=pytest.mark.slow),  # q = p: nothing is rejected
    pytest.param("draft", "draft_v6", T07_TOP4, N_SAMPLES, marks=pytest.mark.slow),  # transforms on p and q
    pytest.param("none", None, T1, N_SAMPLES, marks=pytest.mark.slow),  # the plain sampler, as a control
])
def test_speculative_sampling_keeps_the_target_distribution(tiny_dirs, method, draft, params, n):
    """k = 3: the first decode step verifies drafts at depths 1, 2, 3 (the stats say so) and its
    bonus is token 5; shorter accepted prefixes leave later steps with k = 2, 1, 0."""
    eng = stat_engine(tiny_dirs, method, draft)
    depth = 0 if method == "none" else 3
    check_engine_law(eng, params, n, length=5, depth=depth, rejects=draft != "target_v6")


@pytest.mark.parametrize("bug,at_depth", [
    ("no_residual", None), ("wrong_row", None),
    pytest.param("no_residual", 3, marks=pytest.mark.slow), pytest.param("wrong_row", 3, marks=pytest.mark.slow),
])
def test_the_law_test_rejects_a_broken_chain_verifier(tiny_dirs, monkeypatch, bug, at_depth):
    """Power: the test and sample size of the draft_v6 case above reject a verifier that draws
    the recovered token from p instead of the residual, or that takes p for the accept test from
    the next row, at every depth or only at the deepest (depth 3) one."""
    eng = stat_engine(tiny_dirs, "draft", "draft_v6")
    patch_verifier(monkeypatch, bug, at_depth)
    tokens, _ = sample(eng, T1, N_DEEP, 5, seed0=1000)
    rejected, pvalues = law_rejected(tokens, exact_law(eng, T1, 5))
    assert rejected, pvalues
