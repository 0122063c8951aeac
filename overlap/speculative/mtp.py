"""MTP drafting: the head (overlap/models/heads.py) proposes chains from the target's hidden
states (head_proposer.py has the alignment of head rows and the catch-up they share with EAGLE).

Per step, for a decoding sequence whose last token x_n is not yet through the target:
  propose   draft 1 from the carried logits (head row n-1). For k > 1 the head continues from
            its OWN hidden state (the target's H_n does not exist yet): row n = (d_1, g_{n-1})
            gives draft 2, and so on; these speculative rows are written to the head's KV.
  verify    the target runs [x_n, d_1..d_k] and produces H_n..H_{n+k}.
  re-run    the head runs again over every accepted row with the TARGET's hidden states,
            which are more exact than its own: rows n..n+a = (x_{n+1..n+a+1}, H_{n..n+a}),
            overwriting the speculative KV, and carries the logits and hidden of row n+a.

No-sync schedule (k = 1 for every sequence of a decode batch): the target always processes
2 tokens per sequence, [x_n, d_1], so nothing in the step's shape depends on acceptance. The
head's re-run covers rows n and n+1 with the SAME batch info as the target (positions,
page tables, attention plan): row n's token is the first produced token (d_1 if accepted,
else the recovered one) and row n+1's the second (the bonus, or padding when d_1 was
rejected: wasted work, overwritten next step). The tokens are laid out on the device from
the verifier's output, and the carried row (n + accepted) is picked on the device, so the
re-run is queued right behind verification inside the same launch (the layout says
`catches_up_in_launch`, the executor calls `after_verify`), with no host sync; the produced
ids travel to the host on the copy stream meanwhile.
"""

from __future__ import annotations

import torch

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.batch import BatchPlan, SeqWork
from overlap.device import upload
from overlap.sampling import draw_draft
from overlap.speculative.base import DraftLayout, DraftRequest, Proposal, Verified
from overlap.speculative.head_proposer import HeadProposer


class MTPProposer(HeadProposer):
    name = "mtp"

    def plan(self, batch: BatchPlan, sampled: list[SeqWork], ks: list[int], wait) -> DraftLayout:
        # k = 1 for every sequence of a decode batch: the no-sync schedule (module doc).
        no_sync = (bool(ks) and all(k == 1 for k in ks) and batch.is_decode_only
                   and len(sampled) == len(batch.seqs))
        return DraftLayout.chains(ks, keep_hidden=True, catches_up_in_launch=no_sync)

    # -- stage 2: draft ------------------------------------------------------------------

    def propose(self, request: DraftRequest) -> Proposal:
        seqs, ks, sampling = request.seqs, request.layout.num_drafts, request.sampling
        b, width = len(seqs), request.layout.width
        device = sampling.seed.device
        tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        # Draft i is for position end_pos + i; the head row that predicts it is end_pos - 1 + i.
        rows = [r for r in range(b) if ks[r] > 0]
        # Index tensors staged in pinned memory (no blocking copy of Python lists on CUDA).
        first, rows_t = upload(device, ([seqs[r].end_pos for r in rows], torch.long), (rows, torch.long))
        logits, hidden = self.carried_rows([seqs[r].seq_id for r in rows])  # [rows, V] f32, [rows, H]
        # q for sampled drafts ([B, K, V], V: the full vocabulary); greedy drafts are one-hot: None.
        probs = None if sampling.all_greedy else torch.zeros(b, width, logits.shape[-1], device=device)
        for i in range(width):
            # 1. sample draft i of every row that still drafts, from q_i
            d, q = draw_draft(logits, sampling.select(rows_t), first + i)
            tokens[rows_t, i] = d
            if probs is not None:
                probs[rows_t, i] = q
            # 2. the head on (draft i, its own hidden) for q_{i+1}, where another draft is wanted
            keep = [j for j, r in enumerate(rows) if ks[r] > i + 1]
            if not keep:
                break
            rows_next = [rows[j] for j in keep]
            positions = [seqs[r].end_pos - 1 + i for r in rows_next]  # the row whose token is draft i
            attn = [SeqAttention(1, p + 1, seqs[r].page_table) for p, r in zip(positions, rows_next)]
            if len(keep) < len(rows):
                keep_t, rows_t = upload(device, (keep, torch.long), (rows_next, torch.long))
                d, hidden, first = d[keep_t], hidden[keep_t], first[keep_t]
            logits, hidden = self._run(d, [hidden], positions, attn, list(range(len(keep))))
            rows = rows_next
        return Proposal(tokens, probs)

    # -- right behind verification: the no-sync re-run ------------------------------------

    def after_verify(self, verified: Verified) -> None:
        self.rerun_fixed([s.seq_id for s in verified.seqs], verified.tokens, verified.num_accepted,
                         verified.hidden, verified.positions, verified.backend, verified.meta)

    def rerun_fixed(self, seq_ids: list[int], produced: torch.Tensor, accepted: torch.Tensor,
                    target_hidden: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                    meta) -> None:
        """The no-sync k = 1 re-run, queued right behind verification (see the module doc).

        produced [B, 2] i64 (padding past accepted+1), accepted [B] i64, target_hidden
        [2B, H] and positions [2B] i64: the verify pass's rows (x_n, d_1 per sequence); backend
        and meta: the target's attention plan of that pass, valid for the head too (same
        layer shapes, same page tables and lengths)."""
        b = len(seq_ids)
        rows = torch.arange(b, device=produced.device) * 2 + accepted  # [B]: row n + accepted
        g, logits = self.head(produced.reshape(-1), self.head.target_input(target_hidden), positions, backend,
                              self.kv, meta, rows)
        g = g[rows]
        for i, seq_id in enumerate(seq_ids):
            self.carried[seq_id] = (logits[i], g[i])
            self.pending.pop(seq_id, None)
