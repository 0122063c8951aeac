"""Speculative decoding through the engine: greedy exactness for every drafter, the draft's
KV after rejections, and the target distribution kept under sampling (chi-square)."""

import itertools
import random

import pytest
import torch

from helpers import dense_forward
from overlap.attention import ReferenceBackend, SeqAttention
from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from overlap.kv import slot_mapping
from overlap.sampling import SamplingTensors, probabilities
from overlap.batch import SeqWork
from runtime.engine import Engine
from runtime.messages import SamplingParams
from spec.markov import chi_square_gof, total_variation, tv_tolerance

ALPHA = 1e-4  # false-failure rate of each statistical assertion


def engine(tiny_dirs, method="none", draft="draft", target="target", k=3, page_size=16,
           num_pages=512, max_num_seqs=64, max_batched_tokens=512) -> Engine:
    spec = SpecConfig(method=method, num_spec_tokens=k,
                      draft_model=str(tiny_dirs[draft]) if method == "draft" else None)
    return Engine(EngineConfig(model=str(tiny_dirs[target]), spec=spec,
                               cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                         max_batched_tokens=max_batched_tokens)),
                  progress=False)


def prompts(n, seed):
    rng = random.Random(seed)
    # Repeated phrases give the n-gram drafter something to find.
    out = []
    for _ in range(n):
        base = [rng.randrange(10, 49000) for _ in range(rng.randint(2, 6))]
        out.append((base * rng.randint(2, 6))[: rng.randint(4, 40)])
    return out


@pytest.mark.parametrize("method,draft", [("draft", "draft"), ("draft", "target"), ("ngram", None)])
@pytest.mark.parametrize("batch", [1, 4, 16])
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
    proposer = eng.executor.proposer
    rejected_somewhere = False
    for rid in ids:
        seq = eng.scheduler.by_request[rid]
        rejected_somewhere |= eng.requests[rid].state.stats.num_accepted_tokens < eng.requests[rid].state.stats.num_draft_tokens
        tokens = seq.tokens
        # Fresh pool, same model: run the draft over the accepted sequence in one prefill.
        fresh = proposer.draft.model.new_kv_pool(64, 4)
        backend = ReferenceBackend()
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

PROMPT = [1, 4, 3, 5, 0]
N_SAMPLES = 6000


def exact_three_token_law(model, params: SamplingParams) -> torch.Tensor:
    """[V, V, V] probability of the first three generated tokens, by enumeration."""
    vocab = model.cfg.vocab_size
    work = SeqWork(0, [0], 0, [0], True, params.temperature, params.top_k, params.top_p, 0)
    law = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for a, b in itertools.product(range(vocab), repeat=2):
        _, logits = dense_forward(model, PROMPT + [a, b])
        st = SamplingTensors.from_seqs([work] * 3)
        p = probabilities(logits[-3:], st).double()
        law[a, b] = p[0, a] * p[1, b] * p[2]
    return law


def sample_three_tokens(eng: Engine, params: SamplingParams) -> torch.Tensor:
    counts = torch.zeros([eng.model.cfg.vocab_size] * 3, dtype=torch.long)
    for start in range(0, N_SAMPLES, 500):
        batch = [SamplingParams(max_tokens=3, temperature=params.temperature, top_k=params.top_k,
                                top_p=params.top_p, seed=1000 + start + i, ignore_eos=True) for i in range(500)]
        for r in eng.generate([PROMPT] * 500, batch):
            counts[tuple(r.token_ids)] += 1
    return counts


def assert_keeps_the_three_token_law(eng: Engine, params: SamplingParams) -> None:
    """Chi-square of the first three generated tokens against the exact law, and a total-
    variation bound on each position's marginal."""
    counts = sample_three_tokens(eng, params)
    law = exact_three_token_law(eng.model, params)
    stat, df, p_value = chi_square_gof(counts, law)
    assert p_value > ALPHA, f"chi-square {stat:.1f} on {df} df, p = {p_value:.2e}"
    for axis in range(3):  # per-position marginals, a distribution-free bound
        dims = tuple(d for d in range(3) if d != axis)
        tv = total_variation(counts.sum(dims), law.sum(dims))
        assert tv < tv_tolerance(N_SAMPLES, law.shape[0], ALPHA)


@pytest.mark.parametrize("method,draft,params", [
    ("draft", "draft_v6", SamplingParams(temperature=1.0)),  # a full q different from p
    ("draft", "target_v6", SamplingParams(temperature=1.0)),  # q = p
    ("ngram", None, SamplingParams(temperature=1.0)),  # one-hot q (deterministic drafts)
    ("draft", "draft_v6", SamplingParams(temperature=0.7, top_k=4)),  # transforms on p and q alike
    ("none", None, SamplingParams(temperature=1.0)),  # the plain sampler, as a control
])
def test_speculative_sampling_keeps_the_target_distribution(tiny_dirs, method, draft, params):
    eng = engine(tiny_dirs, method, draft=draft, target="target_v6", k=2, max_num_seqs=500,
                 max_batched_tokens=4096, num_pages=2048)
    assert_keeps_the_three_token_law(eng, params)
