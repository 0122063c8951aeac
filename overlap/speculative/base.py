"""The interface every drafter implements, so the executor's step does not branch on kind.

The executor drives a drafter through three calls per step:
  propose(seqs, ks, sampling) → Proposal        (stage 2: draft tokens and their q)
  catch_up(updates)                             (after the step's sync: feed the drafter the
                                                 tokens it has not seen yet, KV fill)
  release(seq_ids)                              (sequences that ended or were preempted)
A drafter with a model keeps its own KV pool indexed by the scheduler's page tables; its
invariant after catch_up: it has seen every token of the sequence, the last sampled one
included, and holds (carries) its distribution for the next position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from overlap.batch import SeqWork
from overlap.sampling import SamplingTensors


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [B, K] i64 draft tokens (columns past num_drafts[b] are padding)
    # [B, K, V] f32 q at each draft position; None when q is one-hot at the draft tokens
    # (deterministic drafters, greedy drafts): verification then needs no [B, K, V] tensor.
    probs: torch.Tensor | None
    num_drafts: list[int]  # per row, <= the k asked for (n-gram may find fewer)
    host_tokens: list[list[int]] | None = None  # the same drafts as Python ints (host drafters)


@dataclass(frozen=True)
class CatchUp:
    """Tokens a drafter has not seen yet for one sequence, known on the host after the sync."""

    seq_id: int
    start_pos: int  # position of new_tokens[0]
    new_tokens: list[int]
    page_table: list[int]
    hidden: torch.Tensor | None = None  # [n, H] target hidden states of positions start_pos.. (MTP)


class Proposer(Protocol):
    name: str
    on_host: bool  # proposes from host data alone (called while preparing the step)
    reads_hidden: bool  # catch-up reads the target's hidden states (and every row is re-run)

    def propose(self, seqs: list[SeqWork], ks: list[int], sampling: SamplingTensors) -> Proposal: ...

    def catch_up(self, updates: list[CatchUp]) -> None: ...

    def release(self, seq_ids: list[int]) -> None: ...

