"""Prompt-lookup / n-gram drafting: no model, no KV.

The drafts are the tokens that followed the most recent earlier occurrence of the sequence's
last n tokens (n from ngram_max down to ngram_min), as in "prompt lookup decoding"
(Saxena 2023) and vLLM's ngram proposer. Drafts are deterministic, so q is one-hot and the
rejection sampler accepts draft x with probability p(x): still lossless.
"""

from __future__ import annotations

import torch

from overlap.device import upload

from overlap.batch import SeqWork
from overlap.sampling import SamplingTensors
from overlap.speculative.base import CatchUp, Proposal


def lookup(history: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens continuing the latest earlier match of the longest suffix n-gram."""
    size = len(history)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = history[size - n:]
        # Scan right to left: the most recent occurrence predicts best.
        for start in range(size - n - 1, -1, -1):
            if history[start: start + n] == suffix:
                return history[start + n: start + n + k]
    return []


class NgramProposer:
    name = "ngram"
    on_host = True
    reads_hidden = False

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", n_min: int = 1, n_max: int = 3):
        self.vocab_size = vocab_size
        self.device = device
        self.n_min, self.n_max = n_min, n_max
        self.history: dict[int, list[int]] = {}

    def propose(self, seqs: list[SeqWork], ks: list[int], sampling: SamplingTensors) -> Proposal:
        width = max(ks)
        found = [lookup(self.history.get(s.seq_id, []), k, self.n_min, self.n_max) if k else []
                 for s, k in zip(seqs, ks)]
        rows = [f + [0] * (width - len(f)) for f in found]
        # Staged in pinned memory and copied without blocking on CUDA (one copy per step).
        tokens = upload(self.device, (rows, torch.long))[0].view(len(seqs), width)
        return Proposal(tokens, None, [len(f) for f in found], found)  # q: one-hot at the tokens

    def catch_up(self, updates: list[CatchUp]) -> None:
        for u in updates:
            hist = self.history.setdefault(u.seq_id, [])
            del hist[u.start_pos:]  # a recompute after preemption restarts at 0
            hist += u.new_tokens

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.history.pop(i, None)
