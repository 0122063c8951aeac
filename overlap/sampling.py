"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds; no host sync.

Randomness is counter-based: the noise for a draw is a hash of (request seed, absolute
position of the token being drawn, purpose, vocab id). A request therefore samples the same
tokens alone or in any batch, after preemption and recompute, and with or without
speculation's extra draws, and no torch.Generator state has to live per request.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i (as vLLM's sampler does), so one fused pass needs no cumulative sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overlap.batch import SeqWork
from overlap.kernels import argmax_rows

# Purposes, so that draws for different uses at the same position are independent.
NOISE_SAMPLE = 0  # target token (and recovered / bonus tokens)
NOISE_DRAFT = 1  # draft tokens
NOISE_ACCEPT = 2  # the uniform of the accept test
NOISE_TREE = 3  # the uniforms of a tree node's tries (one per child)

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of int64 values in [0, 2^32) (products stay below 2^63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, purpose: int, width: int) -> torch.Tensor:
    """seed, position [B] i64 → [B, width] f32 uniforms in (0, 1), a pure function of its inputs."""
    h = _mix32((seed & _MASK32) ^ ((seed >> 32) & _MASK32) * 0x9E37 & _MASK32)
    h = _mix32(h ^ (position * 0x27D4EB2F & _MASK32))
    h = _mix32(h ^ (purpose * 0x165667B1 & _MASK32))
    col = torch.arange(width, device=seed.device)
    u = _mix32(h[:, None] ^ (col[None, :] * 0x2545F491 & _MASK32))
    # f32 rounds u >= 2^32-128 up to 1.0; then -log(u) = 0 and race() picks p=0 tokens (0/0 = nan).
    return ((u.float() + 0.5) * (1.0 / 4294967296.0)).clamp_max(1.0 - 2.0**-24)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, plus host flags that pick code paths."""

    temperature: torch.Tensor  # [B] f32, 0 = greedy
    top_k: torch.Tensor  # [B] i64, 0 = off
    top_p: torch.Tensor  # [B] f32, 1 = off
    seed: torch.Tensor  # [B] i64
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @staticmethod
    def host_arrays(seqs: list[SeqWork]) -> list[tuple[list, torch.dtype]]:
        """The parameters as (values, dtype) pairs, to stage with a step's other inputs."""
        return [([s.temperature for s in seqs], torch.float32), ([s.top_k for s in seqs], torch.long),
                ([s.top_p for s in seqs], torch.float32), ([s.seed for s in seqs], torch.long)]

    @classmethod
    def from_staged(cls, seqs: list[SeqWork], tensors: list[torch.Tensor]) -> "SamplingTensors":
        """From the device tensors of `host_arrays(seqs)` (in that order) and the host flags."""
        temperature, top_k, top_p, seed = tensors
        return cls(temperature, top_k, top_p, seed,
                   all_greedy=all(s.temperature == 0 for s in seqs),
                   any_greedy=any(s.temperature == 0 for s in seqs),
                   any_top_k=any(s.top_k > 0 for s in seqs),
                   any_top_p=any(s.top_p < 1.0 for s in seqs))

    @classmethod
    def from_seqs(cls, seqs: list[SeqWork], device: torch.device | str = "cpu",
                  repeats: list[int] | None = None) -> "SamplingTensors":
        """One row per sequence, or `repeats[i]` rows for sequence i. Staged in pinned memory
        and copied without blocking on CUDA (overlap.device.upload)."""
        from overlap.device import upload

        reps = repeats or [1] * len(seqs)
        rows = [s for s, r in zip(seqs, reps) for _ in range(r)]
        return cls.from_staged(rows, upload(device, *cls.host_arrays(rows)))

    def repeat_rows(self, n: int) -> "SamplingTensors":
        """Every row n times in a row (verify rows: k+1 per sequence), built on the device."""
        if n == 1:
            return self
        return SamplingTensors(*(t.repeat_interleave(n) for t in (self.temperature, self.top_k, self.top_p,
                                                                  self.seed)),
                               self.all_greedy, self.any_greedy, self.any_top_k, self.any_top_p)

    def select(self, rows: list[int] | torch.Tensor) -> "SamplingTensors":
        """The parameters of these rows only (the host flags are kept: they stay valid).
        rows: host indices, or a device index tensor (what the drafters pass on the hot path)."""
        if len(rows) == self.seed.shape[0]:
            return self
        if isinstance(rows, torch.Tensor):
            idx = rows
        else:
            from overlap.device import upload

            idx = upload(self.seed.device, (rows, torch.long))[0]
        return SamplingTensors(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.seed[idx],
                               self.all_greedy, self.any_greedy, self.any_top_k, self.any_top_p)


def probabilities(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [B, V] f32 → the distribution actually sampled from [B, V] f32.

    Greedy rows become one-hot on the argmax, so the speculative sampler treats greedy and
    sampled rows with the same formulas (min(1, p/q) is then exactly "argmax matches")."""
    if st.all_greedy:  # no temperature, softmax or mask work when nothing is sampled
        return torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    logits = logits / temp[:, None]
    if st.any_top_k or st.any_top_p:
        logits = _mask_top_k_top_p(logits, st)
    probs = torch.softmax(logits, dim=-1)
    if st.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _mask_top_k_top_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if st.any_top_k:
        k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, vocab))
        drop |= ranks >= k[:, None]
    if st.any_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(-1) - probs
        # keep the smallest prefix reaching top_p; top_p = 1 is off (an f32 cumsum reaches 1.0
        # before the tail ends, which would drop tail tokens in rows that asked for no top-p).
        drop |= (mass_before >= st.top_p[:, None]) & (st.top_p[:, None] < 1.0)
    drop[:, 0] = False  # the top token always survives
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] f32 → [R] i64, torch.argmax(x, -1). On the CPU through the compiled kernel:
    torch's argmax there reads one element at a time (84 us a row of 49,152 here, and a step
    takes one per verified row, per draft and per sampled token)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1]:
        return argmax_rows(x)
    return x.argmax(-1)


def race(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, purpose: int) -> torch.Tensor:
    """Draw one index per row from probs [B, V] with counter-based noise → [B] i64."""
    exp_noise = -torch.log(uniform_noise(seed, position, purpose, probs.shape[-1]))
    return row_argmax(probs / exp_noise)


def sample(logits: torch.Tensor, st: SamplingTensors, position: torch.Tensor) -> torch.Tensor:
    """logits [B, V] f32, position [B] i64 (where the sampled token will sit) → tokens [B] i64."""
    if st.all_greedy:
        return row_argmax(logits)
    drawn = race(probabilities(logits, st), st.seed, position, NOISE_SAMPLE)
    return torch.where(st.temperature == 0, row_argmax(logits), drawn)


def draw_draft(logits: torch.Tensor, st: SamplingTensors, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's token for each row: logits [B, V] f32, position [B] i64 (where the draft
    will sit) → (tokens [B] i64, q [B, V] f32, the distribution they were drawn from; None
    when every row is greedy: q is then one-hot at the tokens)."""
    if st.all_greedy:
        return row_argmax(logits), None
    q = probabilities(logits, st)
    return race(q, st.seed, position, NOISE_DRAFT), q
