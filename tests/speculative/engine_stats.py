"""The target distribution through the whole engine (DESIGN.md §6), on the vocab-6 tiny models.

Every request starts from the same PROMPT and generates `length` tokens; the exact law of those
tokens given the prompt is computed by enumerating every prefix (6^(length-1) sequences, one
batched target forward). `length` is chosen per test so that the first decode step verifies
drafts at every depth the test claims and the bonus token after the deepest one falls inside
the checked tokens; `verified_depths` reads the per-request stats to prove it happened.
"""

from __future__ import annotations

import itertools

import torch

from overlap.attention import SeqAttention
from overlap.batch import SeqWork
from overlap.sampling import SamplingTensors, probabilities
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative.markov import assert_law

PROMPT = [1, 4, 3, 5, 0]
_LAWS: dict = {}  # (model dir, sampling, length) → exact law, shared by the engine test files


def batched_logits(model, backend, seqs: list[list[int]]) -> torch.Tensor:
    """One prefill over many equal-length sequences (one page each) → logits [B, T, V], with
    the engine's own attention backend (the law is the one the engine's target defines)."""
    b, t = len(seqs), len(seqs[0])
    kv = model.new_kv_pool(b + 1, t)
    meta = backend.plan([SeqAttention(t, t, [i + 1]) for i in range(b)], t)
    ids = torch.tensor(seqs).reshape(-1)
    positions = torch.arange(t).repeat(b)
    _, logits = model(ids, positions, backend, kv, meta, torch.arange(b * t))
    return logits.view(b, t, -1)


def exact_law(eng: Engine, params: SamplingParams, length: int) -> torch.Tensor:
    """[V] * length f64: the law of the first `length` generated tokens after PROMPT under the
    target with this request's temperature / top-k / top-p."""
    key = (eng.config.model, params.temperature, params.top_k, params.top_p, length)
    if key in _LAWS:
        return _LAWS[key]
    model = eng.model
    vocab = model.cfg.vocab_size
    prefixes = list(itertools.product(range(vocab), repeat=length - 1))
    logits = batched_logits(model, eng.executor.backend, [PROMPT + list(p) for p in prefixes])[:, -length:]  # [B, L, V]
    work = SeqWork(0, [0], 0, [0], True, params.temperature, params.top_k, params.top_p, 0)
    st = SamplingTensors.from_seqs([work] * (len(prefixes) * length))
    p = probabilities(logits.reshape(-1, vocab), st).view(len(prefixes), length, vocab).double()
    p = p / p.sum(-1, keepdim=True)  # f32 rows sum to 1 within ~1e-7
    # law[a_1 .. a_{L-1}, a_L] = prod_i p(a_i | prompt, a_<i) * p(a_L | prompt, a_<L)
    pre = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), length - 1)
    weight = p[:, :-1].gather(2, pre[..., None])[..., 0].prod(1)  # [B]
    law = (weight[:, None] * p[:, -1]).view(*([vocab] * length))
    assert abs(float(law.sum()) - 1) < 1e-9
    _LAWS[key] = law
    return law


def sample(eng: Engine, params: SamplingParams, n: int, length: int, seed0: int,
           max_tokens: int | None = None, batch: int = 1000) -> tuple[torch.Tensor, dict]:
    """n requests from PROMPT with seeds seed0.. → (their first `length` tokens [n, length],
    the per-request speculation stats summed: drafts, drafted/accepted per position)."""
    max_tokens = max_tokens or length
    tokens = torch.empty(n, length, dtype=torch.long)
    keys = ("drafted_per_position", "accepted_per_position", "rejected_per_position")
    stats: dict[str, list[int]] = {key: [] for key in keys}
    for start in range(0, n, batch):
        m = min(batch, n - start)
        ps = [SamplingParams(max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k,
                             top_p=params.top_p, seed=seed0 + start + i, ignore_eos=True) for i in range(m)]
        for i, r in enumerate(eng.generate([PROMPT] * m, ps)):
            tokens[start + i] = torch.tensor(r.token_ids[:length])
            for key in keys:
                for d, x in enumerate(r.stats.get(key, [])):
                    if d == len(stats[key]):
                        stats[key].append(0)
                    stats[key][d] += x
    return tokens, stats


def assert_verified_depths(stats: dict, depth: int, rejects: bool = True) -> None:
    """Drafts were verified at every depth 1..depth, the deepest was accepted (so a bonus token
    followed it) and, unless q = p, drafts were rejected at every depth (so a recovered token was
    drawn there). A draft at depth d was verified in a step iff that step accepted it or first
    rejected there: accepted_per_position[d-1] + rejected_per_position[d-1]."""
    accepted, rejected = stats["accepted_per_position"], stats["rejected_per_position"]
    assert len(accepted) == depth, f"drafts reached depth {len(accepted)}, expected {depth}: {stats}"
    assert accepted[-1] > 0, f"never accepted a depth-{depth} draft (no bonus after it): {stats}"
    if rejects:
        assert all(r > 0 for r in rejected), f"some depth never rejected a draft: {stats}"


def check_engine_law(eng: Engine, params: SamplingParams, n: int, length: int, depth: int,
                     seed0: int = 1000, max_tokens: int | None = None, rejects: bool = True) -> None:
    tokens, stats = sample(eng, params, n, length, seed0, max_tokens)
    if depth:
        assert_verified_depths(stats, depth, rejects)
    assert_law(tokens, exact_law(eng, params, length))
