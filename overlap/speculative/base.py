"""The interface every drafter implements: a proposer describes and runs its own share of the
speculative step, so the executor has one path for every drafter (as vLLM v1's proposers do).

The executor calls, per step (docs/architecture.md §3 has the four stages):
  plan(batch, sampled, ks, wait) → DraftLayout   host, while the step is prepared: what each
        sampled sequence wants verified (how many rows, at which depths, under which mask),
        drafts already known on the host, and what the proposer needs later (the target's
        hidden states kept, its catch-up inside the launch). ks: the drafts the scheduler
        asked for; the layout may grant fewer (a fixed tree: the tree or a chain along its top
        path; a dynamic tree: all or nothing; n-gram finds fewer).
        wait() waits for the device to finish the work queued so far: a proposer that plans
        from device state (EAGLE-2's dynamic trees) calls it, a documented sync.
  propose(request) → Proposal                    stage 2, on the forward stream: draft tokens
        [S, W] and their q (None: one-hot at the tokens).
  after_verify(verified)                          on the forward stream, right behind
        verification, only when the layout says `catches_up_in_launch` (MTP k = 1): the
        drafter catches up without a host sync; `catch_up` is then not called for the step.
  observe(finished)                               on the host, right after the step's sync and
        before the next step is planned: what the step produced (finished.hidden is None).
        A proposer that plans from the tokens on the host (a lookup branch) keeps them here.
  catch_up(finished)                              after the step's sync: the same facts for
        every proposer (the step's sequences, what each produced, its rows, the kept hidden
        states); the proposer picks the tokens it has not seen by its own rule and feeds them
        to its model (KV fill) or its history.
  release(seq_ids)                                sequences that ended or were preempted.
catch_up and release run on the forward stream, in order with the step's device work, unless
the proposer's state lives on the host (`state_on_host`): then at once, on the host thread.

A drafter with a model keeps its own KV pool indexed by the scheduler's page tables; its
invariant after catch_up: it has seen every token of the sequence, the last sampled one
included, and holds (carries) its distribution for the next position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from overlap.attention.base import AttentionBackend
from overlap.batch import BatchPlan, SeqOutput, SeqWork
from overlap.sampling import SamplingTensors


@dataclass(frozen=True)
class TreeLayout:
    """The trees of a step (verified with tree.verify_tree), per sampled sequence; a sequence
    that grows no tree this step (num_drafts 0) has None in each list."""

    parents: list[list[int] | None]  # its nodes' parents, nodes 1..N parents first (0 = the root)
    order: list[list[int] | None]  # each node's index among its siblings: the order they are tried in
    masks: list[torch.Tensor | None]  # [N+1, N+1] bool ancestor mask over [root, nodes]
    depth: int  # deepest node of any tree
    max_children: int  # children per node at most
    # Each tree's top path, the drafter's own chain within it (node ids, root excluded), where
    # the drafter has one: the controller learns chains and trees on the same steps from what
    # that path alone accepted (SeqOutput.top_accepted). None: not reported.
    top_path: list[list[int] | None] | None = None


@dataclass(frozen=True)
class DraftLayout:
    """What a proposer wants verified this step, per sampled sequence (BatchPlan order among
    the sequences that sample), known on the host while the step is prepared."""

    num_drafts: list[int]  # draft rows after the sequence's last token (0: it samples one token)
    width: int  # drafts per sequence in the padded [S, W] layout of verification
    depths: list[list[int]]  # each draft row's depth: its position minus the last token's
    tree: TreeLayout | None = None  # verified as trees (a tree mask); None: as causal chains
    # Drafts known on the host (n-gram lookups, EAGLE-2 trees), staged with the step's inputs
    # and handed to propose() as DraftRequest.host_tokens; None: propose() makes them on the
    # device.
    tokens: list[list[int]] | None = None
    keep_hidden: bool = False  # keep the target's hidden states of the step for catch_up
    catches_up_in_launch: bool = False  # after_verify catches up inside the launch, not catch_up
    # `tokens` holds only some drafts (a lookup branch beside the head's, lookup_branch.py),
    # -1 where propose() fills them in on the device: its proposal is written into the verify
    # rows as for device drafts.
    device_fills: bool = False

    @classmethod
    def chains(cls, ks: list[int], width: int | None = None, tokens: list[list[int]] | None = None,
               **needs: bool) -> "DraftLayout":
        """A chain of ks[i] drafts per sequence, at depths 1..k (consecutive positions)."""
        return cls(list(ks), max(ks, default=0) if width is None else width,
                   [list(range(1, k + 1)) for k in ks], None, tokens, **needs)


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [S, W] i64 draft tokens (columns past the layout's num_drafts are padding)
    # [S, W, V] f32 q at each draft position; None when q is one-hot at the draft tokens
    # (deterministic drafters, greedy drafts, trees): verification then needs no [S, W, V] tensor.
    probs: torch.Tensor | None


@dataclass(frozen=True)
class DraftRequest:
    """Stage 2's inputs, on the forward stream."""

    seqs: list[SeqWork]  # the sampled sequences, in the layout's order
    layout: DraftLayout
    sampling: SamplingTensors  # [S] rows
    host_tokens: torch.Tensor | None  # [S, W] i64 layout.tokens (padded with 0), when it has them


@dataclass(frozen=True)
class Verified:
    """Verification's results on the device, for a proposer that catches up inside the launch."""

    seqs: list[SeqWork]  # the sampled sequences
    tokens: torch.Tensor  # [S, W+1] i64 produced tokens (padding past num_accepted + 1)
    num_accepted: torch.Tensor  # [S] i64
    hidden: torch.Tensor  # [T, H] the verify pass's target hidden states
    positions: torch.Tensor  # [T] i64 the verify pass's positions
    backend: AttentionBackend
    meta: Any  # the verify pass's attention plan


@dataclass(frozen=True)
class CatchUp:
    """Tokens a drafter has not seen yet for one sequence, known on the host after the sync."""

    seq_id: int
    start_pos: int  # position of new_tokens[0]
    new_tokens: list[int]
    page_table: list[int]
    hidden: torch.Tensor | None = None  # [n, H] target hidden states of positions start_pos.. (MTP)


@dataclass(frozen=True)
class FinishedStep:
    """What a step leaves for its drafter, the same facts for every proposer. On the forward
    stream (model drafters) `hidden` exists: the launch has run."""

    seqs: list[SeqWork]  # the plan's sequences
    outputs: list[SeqOutput]  # what each produced (num_drafts, num_accepted), same order
    row_starts: list[int]  # each sequence's first row in the step's flat batch
    # [T, H] the target's hidden states of the step when the layout kept them; on a tree step
    # the accepted path's rows are moved to rows 1..a of the sequence's block, as for a chain.
    hidden: torch.Tensor | None = None

    def followed(self) -> Iterator[tuple[SeqWork, SeqOutput, int]]:
        """(sequence, its output, its first row) of every sequence the drafter follows
        (SeqWork.draft: it speculates, now or later)."""
        for s, out, row in zip(self.seqs, self.outputs, self.row_starts):
            if s.draft:
                yield s, out, row


class Proposer(Protocol):
    name: str
    state_on_host: bool  # no model: catch_up and release run at once on the host thread

    def plan(self, batch: BatchPlan, sampled: list[SeqWork], ks: list[int],
             wait: Callable[[], None]) -> DraftLayout: ...

    def propose(self, request: DraftRequest) -> Proposal: ...

    def after_verify(self, verified: Verified) -> None: ...

    def observe(self, finished: FinishedStep) -> None: ...

    def catch_up(self, finished: FinishedStep) -> None: ...

    def release(self, seq_ids: list[int]) -> None: ...

    def graph_runners(self) -> list:
        """The drafter's own GraphRunners, captured at start-up with the target's."""
        ...
