"""What the MTP head's proposers share (mtp.py drafts chains, eagle.py trees): the head, its
KV pool, the state it carries per sequence, and its catch-up over the rows the target verified.

Alignment (overlap/models/heads.py): head row j pairs token x_{j+1} with the target's hidden
state H_j, sits at position j (KV slot j of the shared page table) and predicts x_{j+2}. So
once the target has produced x_{n+1} from H_n, head row n = (x_{n+1}, H_n) gives the first
draft, for x_{n+2}.

Catch-up: after each step the head re-runs over every row the target verified, with the
TARGET's hidden states (more exact than the head's own, which drafting used past the first
draft): rows n..n+a = (x_{n+1..n+a+1}, H_{n..n+a}) for a accepted drafts, overwriting the
rows drafting wrote, and carries the logits and head hidden state of row n+a. Prefill chunks
and plain decodes fill the head's rows the same way; a row whose next token is still unknown
(at the end of a non-final prompt chunk) waits for the next chunk.
"""

from __future__ import annotations

import torch

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.models.heads import MTPHead
from overlap.speculative.base import CatchUp, FinishedStep


class HeadProposer:
    """The shared part; subclasses plan and propose (chains, fixed trees, dynamic trees)."""

    state_on_host = False

    def __init__(self, head: MTPHead, backend: AttentionBackend, num_pages: int, page_size: int,
                 scratch_page: int | None = None):
        self.head = head
        self.backend = backend
        self.kv = head.new_kv_pool(num_pages + (scratch_page is not None), page_size)
        self.page_size = page_size
        # seq_id → (logits [V] f32 for its next draft, head hidden [H] of that row)
        self.carried: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # seq_id → (position j, H_j [H]) of a row whose token x_{j+1} is not known yet
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}

    def graph_runners(self) -> list:
        return []

    def carried_rows(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The carried state of `seq_ids` as batches: (logits [B, V] f32, head hidden [B, H]).
        One sequence's is a view of its row, not a copy: at batch 1 the two copies, of rows the
        target's pass has just pushed out of the caches, took ~0.09 ms of the worker's step
        (cProfile, EAGLE on the AMD EPYC, session 37)."""
        logits = [self.carried[i][0] for i in seq_ids]
        hidden = [self.carried[i][1] for i in seq_ids]
        if len(seq_ids) == 1:
            return logits[0].unsqueeze(0), hidden[0].unsqueeze(0)
        return torch.stack(logits), torch.stack(hidden)

    def _run(self, ids: torch.Tensor | list[int], hidden: list[torch.Tensor], positions: list[int],
             attn: list[SeqAttention], last_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] (a tensor or a list), hidden [T, H] in parts (MTPHead.forward_rows) → (logits
        [R, V] f32, head hidden [R, H]) at last_rows."""
        g, logits = self.head.forward_rows(ids, hidden, positions, attn, last_rows, self.backend, self.kv,
                                           self.page_size)
        return logits, g

    # -- after the step: the head's rows over what the target computed --------------------

    def observe(self, finished: FinishedStep) -> None:
        pass  # what the head needs (the target's states) is read on the stream, in catch_up

    def catch_up(self, finished: FinishedStep) -> None:
        """Every verified row of the step, re-run with the target's hidden states of the step
        (the layout kept them: keep_hidden)."""
        updates = []
        for s, out, row in finished.followed():
            # The step's own tokens and, on a speculative step, the accepted drafts: the rows
            # whose target hidden states belong to the sequence (a rejected draft's do not).
            verified = len(s.token_ids) + (out.num_accepted if out.num_drafts else 0)
            updates.append(CatchUp(s.seq_id, s.start_pos, s.token_ids + out.token_ids, s.page_table,
                                   finished.hidden[row:row + verified]))
        self.feed(updates)

    def feed(self, updates: list[CatchUp]) -> None:
        """update.new_tokens: the tokens known from update.start_pos on (step inputs, then the
        produced ones); update.hidden [n, H]: the target's H at positions start_pos.. (the
        verified part only; a multi-layer head's features, reduced to [n, H] first)."""
        ids: list[int] = []
        hidden: list[torch.Tensor] = []
        positions: list[int] = []
        attn: list[SeqAttention] = []
        last: list[int] = []
        carried_ids: list[int] = []
        multi_layer = bool(self.head.feature_layers)
        for u in updates:
            s, known = u.start_pos, u.new_tokens
            h = self.head.target_input(u.hidden) if multi_layer else u.hidden
            # Rows j = first .. last: token x_{j+1} = known[j+1-s], hidden H_j.
            first, rows_here = s, h.shape[0]
            pend = self.pending.pop(u.seq_id, None)
            if pend is not None and pend[0] == s - 1:
                first = s - 1  # the row the previous chunk could not fill
            last_row = min(s + rows_here - 1, s + len(known) - 2)  # needs both H_j and x_{j+1}
            if last_row < s + rows_here - 1:
                self.pending[u.seq_id] = (s + rows_here - 1, h[-1])  # x_{j+1} not known yet
                h = h[: max(last_row - s + 1, 0)]
            n = last_row - first + 1
            if n <= 0:
                continue
            ids += [known[j + 1 - s] for j in range(first, last_row + 1)]
            if first < s:
                hidden.append(pend[1])  # one row [H]
            if h.shape[0]:
                hidden.append(h)
            positions += range(first, last_row + 1)
            attn.append(SeqAttention(n, last_row + 1, u.page_table))
            last.append(len(ids) - 1)
            carried_ids.append(u.seq_id)
        if not ids:
            return
        logits, g = self._run(ids, hidden, positions, attn, last)
        for seq_id, row_logits, row_g in zip(carried_ids, logits.unbind(0), g.unbind(0)):
            self.carried[seq_id] = (row_logits, row_g)

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.carried.pop(i, None)
            self.pending.pop(i, None)
