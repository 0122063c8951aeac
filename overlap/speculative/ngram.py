"""Prompt-lookup / n-gram drafting: no model, no KV.

The drafts are the tokens that followed the most recent earlier occurrence of the sequence's
last n tokens (n from ngram_max down to ngram_min), as in "prompt lookup decoding"
(Saxena 2023) and vLLM's ngram proposer. Drafts are deterministic, so q is one-hot and the
rejection sampler accepts draft x with probability p(x): still lossless.

The lookups run on the host while the step is prepared (plan), so the verify pass is sized to
the drafts actually found, and a step where none are found is a plain decode.
"""

from __future__ import annotations

import torch

from overlap.batch import BatchPlan, SeqWork
from overlap.speculative.base import DraftLayout, DraftRequest, FinishedStep, Proposal, Verified


def lookup(history: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens continuing the latest earlier match of the longest suffix n-gram.

    A match d tokens back whose continuation runs into the end of the history (d < k) is
    continued as the text it copies: a run that repeats with period d goes on repeating, so
    draft j is draft j - d. Without that, a sequence in a loop (small models decoding greedily
    fall into them) finds its latest match one period back and copies a single period: a
    1-token loop drafted 1 token a step."""
    size = len(history)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = history[size - n:]
        # Scan right to left: the most recent occurrence predicts best.
        for start in range(size - n - 1, -1, -1):
            if history[start: start + n] == suffix:
                drafts = history[start + n: start + n + k]
                period = size - n - start  # how far back the match is
                while len(drafts) < k:
                    drafts.append(drafts[len(drafts) - period])
                return drafts
    return []


def follow(history: dict[int, list[int]], finished: FinishedStep) -> None:
    """Every token from each followed sequence's step on joins its host history (seq_id →
    tokens), accepted drafts included."""
    for s, out, _ in finished.followed():
        hist = history.setdefault(s.seq_id, [])
        if s.reused_ids:  # the first chunk after a prefix-cache hit: the tokens it skipped
            hist[:] = s.reused_ids
        del hist[s.start_pos:]  # a recompute after preemption restarts at 0
        hist += s.token_ids + out.token_ids


class NgramProposer:
    name = "ngram"
    state_on_host = True

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", n_min: int = 1, n_max: int = 3):
        self.vocab_size = vocab_size
        self.device = device
        self.n_min, self.n_max = n_min, n_max
        self.history: dict[int, list[int]] = {}

    def graph_runners(self) -> list:
        return []

    def plan(self, batch: BatchPlan, sampled: list[SeqWork], ks: list[int], wait) -> DraftLayout:
        found = [lookup(self.history.get(s.seq_id, []), k, self.n_min, self.n_max) if k else []
                 for s, k in zip(sampled, ks)]
        # The padded width stays the k asked for: the verify layout does not depend on luck.
        return DraftLayout.chains([len(f) for f in found], width=max(ks, default=0), tokens=found)

    def propose(self, request: DraftRequest) -> Proposal:
        # Found while planning, staged with the step's inputs; q: one-hot at the tokens.
        return Proposal(request.host_tokens, None)

    def after_verify(self, verified: Verified) -> None:
        pass  # never asked for: the history catches up after the sync

    def observe(self, finished: FinishedStep) -> None:
        pass  # catch_up runs on the host too (state_on_host), at once

    def catch_up(self, finished: FinishedStep) -> None:
        # Unlike a draft model, nothing ran the drafts through this history while proposing.
        follow(self.history, finished)

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.history.pop(i, None)
