"""The step's input: what the scheduler asks the executor to run. Crosses the wire as is."""

from __future__ import annotations

import msgspec


class SeqWork(msgspec.Struct, array_like=True, frozen=True):
    """One sequence's share of a step.

    `token_ids` are the tokens whose KV this step computes: a prompt chunk, or the single
    last token of a decoding sequence. They occupy positions start_pos .. start_pos+len-1.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int  # tokens of this sequence already in the KV cache
    page_table: list[int]  # page ids covering at least start_pos + len(token_ids) (+ spec slack)
    sample: bool  # the chunk ends the known tokens: sample the next one
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # every request has one; noise is keyed by (seed, position), see sampling.py
    num_spec_tokens: int = 0  # drafts to propose this step (0: no speculation this step)
    draft: bool = False  # the sequence speculates: the drafter must follow its tokens
    lookup_rows: int = 0  # rows reserved beyond the drafts for a lookup branch (lookup_branch.py)
    # tokens 0..start_pos found in the prefix cache, on a drafting sequence's first chunk after
    # the hit (else empty): for drafters that keep the sequence's tokens on the host
    reused_ids: list[int] = []
    # The lookup branch's tokens, found by the scheduler on the sequence's host history before
    # its controller chose (so it priced the branch as it is, not by how often one fires);
    # None: not looked up there (lookup_branch.py then looks up itself).
    branch: list[int] | None = None

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.sample and self.start_pos > 0


class BatchPlan(msgspec.Struct, array_like=True, frozen=True):
    step_id: int
    seqs: list[SeqWork]
    freed_seq_ids: list[int] = []  # sequences that ended: drop their executor-side state

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence feeds back its last sampled token (no prompt chunk in the batch)."""
        return all(s.is_decode for s in self.seqs)


class SeqOutput(msgspec.Struct, array_like=True, frozen=True):
    """Tokens a step produced for one sequence (empty for a non-final prefill chunk)."""

    seq_id: int
    token_ids: list[int]
    num_drafts: int = 0  # draft tokens proposed this step (a tree, a branch: the deepest path)
    num_accepted: int = 0  # of which the target accepted
    num_rows: int = 0  # draft rows verified: a chain's k, a tree's nodes, plus a lookup branch's
    # A tree's accepted drafts that lie on its top path (the first-tried child at each level):
    # what a chain along that path would have accepted. -1: the step verified no tree for it.
    top_accepted: int = -1


class StepOutput(msgspec.Struct, array_like=True, frozen=True):
    step_id: int
    seqs: list[SeqOutput]
