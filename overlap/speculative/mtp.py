"""MTP drafting: the head (overlap/models/heads.py) proposes from the target's hidden states.

Alignment (heads.py): head row j pairs token x_{j+1} with the target's hidden state H_j, sits
at position j (KV slot j of the shared page table) and predicts x_{j+2}. So once the target
has produced x_{n+1} from H_n, head row n = (x_{n+1}, H_n) gives the first draft, for x_{n+2}.

Per step, for a decoding sequence whose last token x_n is not yet through the target:
  propose   draft 1 from the carried logits (head row n-1). For k > 1 the head continues from
            its OWN hidden state (the target's H_n does not exist yet): row n = (d_1, g_{n-1})
            gives draft 2, and so on; these speculative rows are written to the head's KV.
  verify    the target runs [x_n, d_1..d_k] and produces H_n..H_{n+k}.
  re-run    the head runs again over every accepted row with the TARGET's hidden states,
            which are more exact than its own: rows n..n+a = (x_{n+1..n+a+1}, H_{n..n+a}),
            overwriting the speculative KV, and carries the logits and hidden of row n+a.
Prefill chunks and plain decodes fill the head's rows the same way (a row whose next token
is still unknown, at the end of a non-final prompt chunk, waits for the next chunk).

No-sync schedule (k = 1 for every sequence of a decode batch): the target always processes
2 tokens per sequence, [x_n, d_1], so nothing in the step's shape depends on acceptance. The
head's re-run covers rows n and n+1 with the SAME batch info as the target (positions,
page tables, attention plan): row n's token is the first produced token (d_1 if accepted,
else the recovered one) and row n+1's the second (the bonus, or padding when d_1 was
rejected: wasted work, overwritten next step). The tokens are laid out on the device from
the verifier's output, and the carried row (n + accepted) is picked on the device, so the
executor queues the re-run right behind verification inside the same launch, with no host
sync; the produced ids travel to the host on the copy stream meanwhile.
"""

from __future__ import annotations

import torch

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.batch import SeqWork
from overlap.device import upload
from overlap.models.heads import MTPHead
from overlap.sampling import SamplingTensors, draw_draft
from overlap.speculative.base import CatchUp, Proposal


class MTPProposer:
    name = "mtp"
    on_host = False
    reads_hidden = True  # catch-up needs the target's hidden states (CatchUp.hidden)

    def __init__(self, head: MTPHead, backend: AttentionBackend, num_pages: int, page_size: int,
                 scratch_page: int | None = None):
        self.head = head
        self.backend = backend
        self.kv = head.new_kv_pool(num_pages + (scratch_page is not None), page_size)
        self.page_size = page_size
        cfg = head.cfg
        self._attn_dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, head.dtype)
        # seq_id → (logits [V] f32 for its next draft, head hidden [H] of that row)
        self.carried: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # seq_id → (position j, H_j [H]) of a row whose token x_{j+1} is not known yet
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}

    def _run(self, ids: torch.Tensor, hidden: torch.Tensor, positions: list[int], attn: list[SeqAttention],
             last_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] i64, hidden [T, H] → (logits [R, V] f32, head hidden [R, H]) at last_rows."""
        meta = self.backend.plan(attn, self.page_size, *self._attn_dims)
        pos, rows = upload(ids.device, (positions, torch.long), (last_rows, torch.long))
        g, logits = self.head(ids, hidden, pos, self.backend, self.kv, meta, rows)
        return logits, g[rows]

    # -- stage 2: draft ------------------------------------------------------------------

    def propose(self, seqs: list[SeqWork], ks: list[int], sampling: SamplingTensors) -> Proposal:
        b, width = len(seqs), max(ks)
        device = sampling.seed.device
        tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        # Draft i is for position end_pos + i; the head row that predicts it is end_pos - 1 + i.
        rows = [r for r in range(b) if ks[r] > 0]
        # Index tensors staged in pinned memory (no blocking copy of Python lists on CUDA).
        first, rows_t = upload(device, ([seqs[r].end_pos for r in rows], torch.long), (rows, torch.long))
        logits = torch.stack([self.carried[seqs[r].seq_id][0] for r in rows])  # [rows, V] f32
        # q for sampled drafts ([B, K, V], V: the full vocabulary); greedy drafts are one-hot: None.
        probs = None if sampling.all_greedy else torch.zeros(b, width, logits.shape[-1], device=device)
        hidden = torch.stack([self.carried[seqs[r].seq_id][1] for r in rows])  # [rows, H]
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
            logits, hidden = self._run(d, hidden, positions, attn, list(range(len(keep))))
            rows = rows_next
        return Proposal(tokens, probs, list(ks))

    # -- after the step: the head's rows over what the target computed --------------------

    def catch_up(self, updates: list[CatchUp]) -> None:
        """update.new_tokens: the tokens known from update.start_pos on (step inputs, then the
        produced ones); update.hidden [n, H]: the target's H at positions start_pos.. (the
        verified part only; a multi-layer head's features, reduced to [n, H] first)."""
        ids: list[int] = []
        hidden: list[torch.Tensor] = []
        positions: list[int] = []
        attn: list[SeqAttention] = []
        last: list[int] = []
        carried_ids: list[int] = []
        for u in updates:
            s, known, h = u.start_pos, u.new_tokens, self.head.target_input(u.hidden)
            # Rows j = first .. last: token x_{j+1} = known[j+1-s], hidden H_j.
            first = s
            row_hidden = [h]
            pend = self.pending.pop(u.seq_id, None)
            if pend is not None and pend[0] == s - 1:
                first = s - 1  # the row the previous chunk could not fill
                row_hidden = [pend[1][None], h]
            last_row = min(s + h.shape[0] - 1, s + len(known) - 2)  # needs both H_j and x_{j+1}
            if last_row < s + h.shape[0] - 1:
                self.pending[u.seq_id] = (s + h.shape[0] - 1, h[-1])  # x_{j+1} not known yet
            n = last_row - first + 1
            if n <= 0:
                continue
            ids += [known[j + 1 - s] for j in range(first, last_row + 1)]
            hidden.append(torch.cat(row_hidden)[:n])
            positions += range(first, last_row + 1)
            attn.append(SeqAttention(n, last_row + 1, u.page_table))
            last.append(len(ids) - 1)
            carried_ids.append(u.seq_id)
        if not ids:
            return
        device = hidden[0].device
        logits, g = self._run(upload(device, (ids, torch.long))[0], torch.cat(hidden), positions,
                              attn, last)
        for i, seq_id in enumerate(carried_ids):
            self.carried[seq_id] = (logits[i], g[i])

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

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.carried.pop(i, None)
            self.pending.pop(i, None)
