"""overlap.sampling: greedy, temperature, top-k, top-p, and the counter-based noise.

Statistical asserts use fixed seeds, so the file is deterministic. Were the seeds random, a
correct sampler would fail each chi-square / KS assert with probability ALPHA; this file makes
16 of them, plus 3 correlation asserts at |z| > 4.5 (under 2e-3 in all). Many draws come from one call: the noise is keyed by
(seed, position, purpose), so rows of one big batch with different seeds are independent draws.
"""

from __future__ import annotations

import math

import torch

from overlap.sampling import (
    NOISE_ACCEPT,
    NOISE_DRAFT,
    NOISE_SAMPLE,
    SamplingTensors,
    probabilities,
    race,
    sample,
    uniform_noise,
)

ALPHA = 1e-4


# ----------------------------------------------------------------------------- statistics


def chi2_sf(x: float, df: int) -> float:
    """Chi-square survival function without scipy: the regularized upper gamma Q(df/2, x/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit over the cells where probs > 0 (all expected counts here are >= 5)."""
    c, p = counts.double(), probs.double()
    assert int(c[p == 0].sum()) == 0, "drew a token of probability 0"
    c, p = c[p > 0], p[p > 0] / p[p > 0].sum()
    exp = c.sum() * p
    assert bool((exp >= 5).all()), "test design: too few samples per cell"
    return chi2_sf(float(((c - exp) ** 2 / exp).sum()), c.numel() - 1)


def independence_pvalue(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    """Chi-square test that paired draws a, b [N] i64 are independent."""
    t = torch.bincount(a * vocab + b, minlength=vocab * vocab).view(vocab, vocab).double()
    exp = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    return chi2_sf(float(((t - exp) ** 2 / exp).sum()), (vocab - 1) ** 2)


def st_rows(temperature, top_k=None, top_p=None, seed=None) -> SamplingTensors:
    temperature = torch.as_tensor(temperature, dtype=torch.float32)
    n = temperature.numel()
    top_k = torch.zeros(n, dtype=torch.long) if top_k is None else torch.as_tensor(top_k).long()
    top_p = torch.ones(n) if top_p is None else torch.as_tensor(top_p, dtype=torch.float32)
    seed = torch.arange(n, dtype=torch.long) if seed is None else torch.as_tensor(seed).long()
    return SamplingTensors(
        temperature=temperature, top_k=top_k.expand(n).clone(), top_p=top_p.expand(n).clone(),
        seed=seed.expand(n).clone(), all_greedy=bool((temperature == 0).all()),
        any_greedy=bool((temperature == 0).any()), any_top_k=bool((top_k > 0).any()),
        any_top_p=bool((top_p < 1).any()))


def draw(logits_row: torch.Tensor, n: int, temperature=1.0, top_k=0, top_p=1.0, seed0=0):
    """n independent samples of one logits row: one batch, a different seed per row."""
    st = st_rows(torch.full((n,), temperature), torch.tensor(top_k), torch.tensor(top_p),
                 seed=torch.arange(seed0, seed0 + n))
    position = 17 + torch.arange(n) % 5  # positions vary too; (seed, position) pairs stay distinct
    return sample(logits_row.expand(n, -1), st, position)


LOGITS = torch.tensor([2.0, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0, -2.0])  # [V=8], no ties


# ----------------------------------------------------------------------------- greedy / temperature


def test_greedy_rows_are_argmax_alone_and_mixed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g)
    pos = torch.arange(64)
    assert torch.equal(sample(logits, st_rows(torch.zeros(64)), pos), logits.argmax(-1))
    temp = torch.where(torch.arange(64) % 2 == 0, 0.0, 1.0)  # greedy and sampled in one batch
    topk = torch.where(torch.arange(64) % 3 == 0, 5, 0)
    topp = torch.where(torch.arange(64) % 5 == 0, 0.5, 1.0)
    out = sample(logits, st_rows(temp, topk, topp), pos)
    assert torch.equal(out[temp == 0], logits.argmax(-1)[temp == 0])
    probs = probabilities(logits, st_rows(temp, topk, topp))
    assert torch.equal(probs[temp == 0], torch.nn.functional.one_hot(logits.argmax(-1), 1000)[temp == 0].float())


def test_temperature_follows_softmax():
    for i, t in enumerate([0.5, 1.0, 2.0]):
        tokens = draw(LOGITS, 40_000, temperature=t, seed0=i * 10**6)
        counts = torch.bincount(tokens, minlength=8)
        pval = chi_square_pvalue(counts, torch.softmax(LOGITS / t, -1))
        assert pval > ALPHA, (t, counts, pval)


# ----------------------------------------------------------------------------- top-k / top-p


def _reference_keep(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The kept set, computed in f64 on the host, one row at a time → [V] bool."""
    order = (logits.double() / temperature).argsort(descending=True)
    k = top_k if top_k > 0 else logits.numel()
    probs = torch.softmax(logits.double()[order[:k]] / temperature, -1)
    cum = probs.cumsum(0)
    m = int((cum < top_p).sum()) + 1 if top_p < 1 else k  # smallest prefix with mass >= top_p
    keep = torch.zeros(logits.numel(), dtype=torch.bool)
    keep[order[: min(m, k)]] = True
    return keep


def test_top_k_top_p_keep_exactly_the_expected_set():
    g = torch.Generator().manual_seed(1)
    n, vocab = 300, 50
    logits = 2.0 * torch.randn(n, vocab, generator=g)
    temp = 0.5 + torch.rand(n, generator=g)
    top_k = torch.randint(0, 12, (n,), generator=g)  # 0 = off
    top_p = torch.where(torch.rand(n, generator=g) < 0.3, torch.tensor(1.0), 0.05 + 0.9 * torch.rand(n, generator=g))
    probs = probabilities(logits, st_rows(temp, top_k, top_p))
    checked = 0
    for r in range(n):
        t, k, p = float(temp[r]), int(top_k[r]), float(top_p[r])
        # skip rows where f32 rounding could flip the boundary decision
        kk = k if k else vocab
        srt = torch.softmax(logits[r].double().sort(descending=True).values[:kk] / t, -1).cumsum(0)
        if p < 1 and bool(((srt - p).abs() < 1e-4).any()):
            continue
        keep = _reference_keep(logits[r], t, k, p)
        assert torch.equal(probs[r] > 0, keep), (r, t, k, p)
        expect = torch.softmax((logits[r] / t).masked_fill(~keep, float("-inf")), -1)
        torch.testing.assert_close(probs[r], expect)
        checked += 1
    assert checked > 250
    # the exact top-k set, and the top token always survives any top_p
    one = probabilities(logits, st_rows(torch.ones(n), torch.full((n,), 3), torch.full((n,), 1e-6)))
    assert torch.equal((one > 0).sum(-1), torch.ones(n, dtype=torch.long))
    assert torch.equal(one.argmax(-1), logits.argmax(-1))
    three = probabilities(logits, st_rows(torch.ones(n), torch.full((n,), 3)))
    assert torch.equal((three > 0).nonzero()[:, 1].view(n, 3).sort(-1).values,
                       logits.topk(3, -1).indices.sort(-1).values)


def test_truncated_sampling_follows_renormalized_distribution():
    cases = [  # (temperature, top_k, top_p)
        (1.0, 3, 1.0),
        (1.0, 0, 0.7),
        (0.8, 5, 0.8),  # top-p over the renormalized top-5
        (1.5, 0, 0.95),
    ]
    for i, (t, k, p) in enumerate(cases):
        keep = _reference_keep(LOGITS, t, k, p)
        assert 1 < int(keep.sum()) < 8, "test design: truncation must matter"
        expect = torch.softmax((LOGITS / t).masked_fill(~keep, float("-inf")), -1)
        tokens = draw(LOGITS, 20_000, temperature=t, top_k=k, top_p=p, seed0=(10 + i) * 10**6)
        pval = chi_square_pvalue(torch.bincount(tokens, minlength=8), expect)  # also: no p=0 draws
        assert pval > ALPHA, ((t, k, p), pval)


def test_top_p_off_rows_are_unaffected_by_top_p_rows():
    """top_p = 1 means off: a row's distribution is the same with or without top-p rows in the
    batch (an f32 cumsum reaches 1.0 before a long tail ends; that must not drop the tail)."""
    g = torch.Generator().manual_seed(2)
    logits = 3.0 * torch.randn(8, 32_000, generator=g)
    alone = probabilities(logits, st_rows(torch.ones(8)))
    mixed = probabilities(logits, st_rows(torch.ones(8), top_p=torch.tensor([0.9] + [1.0] * 7)))
    assert torch.equal(mixed[1:], alone[1:])
    assert bool((alone > 0).all())


# ----------------------------------------------------------------------------- noise


def test_same_seed_and_position_same_token_alone_or_batched():
    g = torch.Generator().manual_seed(3)
    n, vocab = 48, 300
    logits = torch.randn(n, vocab, generator=g)
    temp = torch.where(torch.arange(n) % 4 == 0, 0.0, 0.7 + torch.rand(n, generator=g))
    top_k = torch.where(torch.arange(n) % 3 == 0, 20, 0)
    top_p = torch.where(torch.arange(n) % 5 == 0, 0.8, 1.0)
    seed = torch.randint(0, 2**62, (n,), generator=g)
    pos = torch.randint(0, 10**6, (n,), generator=g)
    st = st_rows(temp, top_k, top_p, seed)
    batched = sample(logits, st, pos)
    for r in range(n):
        one = st_rows(temp[r:r + 1], top_k[r:r + 1], top_p[r:r + 1], seed[r:r + 1])
        assert int(sample(logits[r:r + 1], one, pos[r:r + 1])) == int(batched[r]), r
    # and the same rows in another order inside another batch
    perm = torch.randperm(n, generator=g)
    shuffled = sample(logits[perm], st_rows(temp[perm], top_k[perm], top_p[perm], seed[perm]), pos[perm])
    assert torch.equal(shuffled, batched[perm])


def test_draws_are_independent_across_positions_purposes_and_seeds():
    n, vocab = 40_000, 6
    probs = torch.softmax(torch.tensor([1.0, 0.5, 0.2, 0.0, -0.3, -0.8]), -1).expand(n, -1)
    seed = torch.arange(n, dtype=torch.long) * 7919
    pos = 1000 + torch.arange(n) % 13
    base = race(probs, seed, pos, NOISE_SAMPLE)
    pairs = {
        "next position": race(probs, seed, pos + 1, NOISE_SAMPLE),
        "far position": race(probs, seed, pos + 4096, NOISE_SAMPLE),
        "draft purpose": race(probs, seed, pos, NOISE_DRAFT),
        "accept purpose": race(probs, seed, pos, NOISE_ACCEPT),
        "next seed": race(probs, seed + 1, pos, NOISE_SAMPLE),
        "high seed bits": race(probs, seed + (1 << 32), pos, NOISE_SAMPLE),
    }
    for name, other in pairs.items():
        pval = independence_pvalue(base, other, vocab)
        assert pval > ALPHA, (name, pval)
        assert float((base == other).float().mean()) < 0.5, name  # not copies of each other
    # the pair (position t, position t+1) of one seed also has the right joint law
    pval = chi_square_pvalue(torch.bincount(base * vocab + pairs["next position"], minlength=vocab**2),
                             (probs[0][:, None] * probs[0][None, :]).reshape(-1))
    assert pval > ALPHA


def test_uniform_noise_in_open_interval_and_uniform():
    g = torch.Generator().manual_seed(4)
    seed = torch.randint(0, 2**62, (4000,), generator=g)
    pos = torch.randint(0, 2**20, (4000,), generator=g)
    u = uniform_noise(seed, pos, NOISE_SAMPLE, 256)  # [4000, 256]
    assert u.dtype == torch.float32 and u.shape == (4000, 256)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert torch.equal(u, uniform_noise(seed, pos, NOISE_SAMPLE, 256))  # a pure function
    assert torch.equal(u[:, :10], uniform_noise(seed, pos, NOISE_SAMPLE, 10))  # width-invariant
    flat = u.reshape(-1).double()
    # chi-square over 100 equal bins (~10k per bin)
    counts = torch.bincount((flat * 100).long().clamp(max=99), minlength=100)
    assert chi_square_pvalue(counts, torch.full((100,), 0.01)) > ALPHA
    # Kolmogorov–Smirnov on a subsample (asymptotic Kolmogorov distribution)
    x = flat[::16].sort().values
    m = x.numel()
    i = torch.arange(1, m + 1, dtype=torch.float64)
    d = float(torch.maximum(i / m - x, x - (i - 1) / m).max())
    lam = (math.sqrt(m) + 0.12 + 0.11 / math.sqrt(m)) * d
    ks_p = 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 100))
    assert min(max(ks_p, 0.0), 1.0) > ALPHA, (d, ks_p)
    # neighbouring columns, seeds and positions are not correlated (Pearson r ~ N(0, 1/n))
    n = 100_000
    seq = torch.arange(n, dtype=torch.long)
    by_seed = uniform_noise(seq, torch.full((n,), 5), NOISE_SAMPLE, 2)  # seeds 0, 1, 2, ...
    by_pos = uniform_noise(torch.full((n,), 5), seq, NOISE_SAMPLE, 1)[:, 0]  # positions 0, 1, ...
    for a, b in [(by_seed[:, 0], by_seed[:, 1]), (by_seed[:-1, 0], by_seed[1:, 0]), (by_pos[:-1], by_pos[1:])]:
        r = float(torch.corrcoef(torch.stack([a, b]).double())[0, 1])
        assert abs(r) < 4.5 / math.sqrt(n), r  # |z| > 4.5: p < 1e-5


def test_noise_never_reaches_one_and_race_never_picks_zero_probability():
    """Regression: (u + 0.5) / 2^32 computed in f32 rounded the top 128 hash values to exactly 1.0,
    -log(1) = 0, and race() then divided 0 by 0 for masked tokens: argmax returned the NaN, a token
    of probability 0 (found for seed 1162, position 7, vocab id 7447)."""
    seed, pos = torch.tensor([1162]), torch.tensor([7])
    u = uniform_noise(seed, pos, NOISE_SAMPLE, 7448)
    assert float(u.max()) < 1.0
    one_hot = torch.zeros(1, 7448)
    one_hot[0, 0] = 1.0
    assert int(race(one_hot, seed, pos, NOISE_SAMPLE)) == 0
    logits = torch.zeros(1, 7448)
    logits[0, 0] = 1.0
    assert int(sample(logits, st_rows(torch.ones(1), torch.tensor([1]), seed=seed), pos)) == 0
