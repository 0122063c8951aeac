"""Draft-target speculation: a small LLM that shares the target's tokenizer proposes a chain.

The draft has its own KV pool, indexed by the SAME page tables as the target's (the
scheduler allocates once per sequence for both). Stages (docs/architecture.md §3):
  prefill / plain steps: after the target, the draft catches up on the step's tokens, the
      sampled one included, and its last logits are carried to the next step;
  propose: a chain of k drafts per sequence (base.DraftLayout.chains); the first comes from the
      carried logits, then the draft runs k-1 times;
  after verification: the draft runs once over the tokens it has not seen (the last draft
      if every draft was accepted, and the recovered/bonus token: unseen_tokens)
      and carries new logits.
The draft may score only part of the vocabulary (`vocab_ids`, the target's most frequent
tokens, as in FR-Spec): q is then zero elsewhere, which the rejection sampler handles
losslessly, and the draft's lm_head costs a fraction of the target's.
"""

from __future__ import annotations

import torch

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.batch import BatchPlan, SeqWork
from overlap.device import upload
from overlap.graphs import GraphRunner
from overlap.models.llama import LlamaModel, logits_linear, spread_vocabulary
from overlap.sampling import draw_draft
from overlap.speculative.base import CatchUp, DraftLayout, DraftRequest, FinishedStep, Proposal, Verified


class DraftModel:
    """A LlamaModel whose logits cover `vocab_ids` of the target vocabulary (all if None)."""

    def __init__(self, model: LlamaModel, vocab_size: int, vocab_ids: torch.Tensor | None):
        self.model = model
        self.vocab_size = vocab_size
        # [Vd] i64 ascending and distinct, or None (the rows below follow the ids, so the
        # order a draft directory stores them in is free)
        self.vocab_ids = None if vocab_ids is None else torch.unique(vocab_ids)
        head = model.lm_head
        # A gathered copy of the shared lm_head rows: [Vd, hidden], a few MB.
        self.lm_head = head if self.vocab_ids is None else head[self.vocab_ids].contiguous()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → [N, vocab] f32, -inf outside vocab_ids."""
        sub = logits_linear(hidden, self.lm_head, self.model.linear)
        if self.vocab_ids is None:
            return sub
        return spread_vocabulary(sub, self.vocab_ids, self.vocab_size)


class DraftTargetProposer:
    name = "draft"
    state_on_host = False
    # Its catch-up skips the accepted drafts it ran itself (unseen_tokens): a lookup branch
    # beside it must report a step whose walk followed the branch (lookup_branch.py).
    trusts_own_drafts = True

    def __init__(self, draft: DraftModel, backend: AttentionBackend, num_pages: int, page_size: int,
                 scratch_page: int | None = None):
        self.draft = draft
        self.backend = backend
        self.kv = draft.model.new_kv_pool(num_pages + (scratch_page is not None), page_size)
        self.page_size = page_size
        # The k-1 single-token draft steps of a proposal: padded to a bucket and replayed as a
        # CUDA graph when a scratch page is given (see overlap/graphs.py).
        self.step_runner = None if scratch_page is None else GraphRunner(
            draft.model, self.kv, backend, 1, scratch_page=scratch_page, head=draft.logits, name="draft")
        cfg = draft.model.cfg
        self._attn_dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, draft.model.dtype)
        self.carried: dict[int, torch.Tensor] = {}  # seq_id → [V] f32 logits for the next position

    def _forward(self, ids: torch.Tensor, positions: list[int], attn: list[SeqAttention],
                 last_rows: list[int]) -> torch.Tensor:
        """ids [T] i64 → draft logits [len(last_rows), V] f32 at the given rows."""
        meta = self.backend.plan(attn, self.page_size, *self._attn_dims)
        pos, rows = upload(ids.device, (positions, torch.long), (last_rows, torch.long))
        hidden, _ = self.draft.model(ids, pos, self.backend, self.kv, meta)
        return self.draft.logits(hidden[rows])

    def _step(self, ids: torch.Tensor, positions: list[int], attn: list[SeqAttention]) -> torch.Tensor:
        """One draft token per sequence: ids [B] i64 → logits [B, V] f32."""
        if self.step_runner is None:
            return self._forward(ids, positions, attn, list(range(len(attn))))
        pos, = upload(ids.device, (positions, torch.long))
        rows = torch.arange(len(attn), device=ids.device)
        return self.step_runner.forward(ids, pos, attn, rows)[1]

    def graph_runners(self) -> list[GraphRunner]:
        return [] if self.step_runner is None else [self.step_runner]

    def plan(self, batch: BatchPlan, sampled: list[SeqWork], ks: list[int], wait) -> DraftLayout:
        return DraftLayout.chains(ks)

    def propose(self, request: DraftRequest) -> Proposal:
        """A chain of ks[i] drafts for sequence i, from the carried logits on."""
        seqs, ks, sampling = request.seqs, request.layout.num_drafts, request.sampling
        b, width = len(seqs), request.layout.width
        device = sampling.seed.device
        tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        # q for sampled drafts; greedy drafts are one-hot at their tokens: None, no [B, K, V].
        probs = None if sampling.all_greedy else torch.zeros(b, width, self.draft.vocab_size, device=device)
        # Draft i sits at position end_pos + i (end_pos: where the target's next token goes).
        rows = [r for r in range(b) if ks[r] > 0]  # sequences with speculation off propose nothing
        # Index tensors staged in pinned memory (no blocking copy of Python lists on CUDA).
        first, rows_t = upload(device, ([seqs[r].end_pos for r in rows], torch.long), (rows, torch.long))
        logits = torch.stack([self.carried[seqs[r].seq_id] for r in rows])  # [rows, V] f32
        for i in range(width):
            # 1. sample draft i of every row that still drafts, from q_i.
            d, q = draw_draft(logits, sampling.select(rows_t), first + i)
            tokens[rows_t, i] = d
            if probs is not None:
                probs[rows_t, i] = q
            # 2. run the draft on it to get q_{i+1}, for rows that need another draft.
            keep = [j for j, r in enumerate(rows) if ks[r] > i + 1]  # positions within rows
            if not keep:
                break
            rows_next = [rows[j] for j in keep]
            attn = [SeqAttention(1, seqs[r].end_pos + i + 1, seqs[r].page_table) for r in rows_next]
            if len(keep) < len(rows):
                keep_t, rows_t = upload(device, (keep, torch.long), (rows_next, torch.long))
                d, first = d[keep_t], first[keep_t]
            logits = self._step(d, [seqs[r].end_pos + i for r in rows_next], attn)
            rows = rows_next
        return Proposal(tokens, probs)

    def after_verify(self, verified: Verified) -> None:
        pass  # never asked for: the draft catches up after the sync

    def observe(self, finished: FinishedStep) -> None:
        pass  # the draft's tokens come with its catch-up, on the stream

    def catch_up(self, finished: FinishedStep) -> None:
        self.feed(unseen_tokens(finished))

    def feed(self, updates: list[CatchUp]) -> None:
        """Run the draft over each update's tokens (KV fill); carry the logits of the last."""
        if not updates:
            return
        ids, positions, attn, last = [], [], [], []
        for u in updates:
            ids += u.new_tokens
            positions += range(u.start_pos, u.start_pos + len(u.new_tokens))
            attn.append(SeqAttention(len(u.new_tokens), u.start_pos + len(u.new_tokens), u.page_table))
            last.append(len(ids) - 1)
        device = self.draft.model.embed_tokens.device
        logits = self._forward(upload(device, (ids, torch.long))[0], positions, attn, last)
        for u, row in zip(updates, logits):
            self.carried[u.seq_id] = row

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.carried.pop(i, None)


def unseen_tokens(finished: FinishedStep) -> list[CatchUp]:
    """The tokens the draft model has not seen: from the step's first token, except on a
    speculative step, where the draft already ran drafts 1..k-1 through its KV while
    proposing (the accepted ones are valid there): from the first token it has not run, the
    recovered token, or the last draft (if all were accepted) and the bonus."""
    updates = []
    for s, out, _ in finished.followed():
        known = s.token_ids + out.token_ids  # from position s.start_pos on
        skip = 1 + min(out.num_accepted, out.num_drafts - 1) if out.num_drafts else 0
        # Elsewhere the step's input token is fed again (an identical KV rewrite) so that
        # prefill chunks, plain decodes and recomputes after preemption share one rule.
        updates.append(CatchUp(s.seq_id, s.start_pos + skip, known[skip:], s.page_table))
    return updates


def load_draft(draft_dir, target: LlamaModel, matmul: str | None = None) -> DraftModel:
    """A draft directory holds config.json and model.safetensors with the decoder layers, the
    final norm and optionally `vocab_ids`; embeddings and lm_head are the target's (shared).
    matmul: the draft's matmuls (None: the target's; "int8": weight-only int8)."""
    from overlap.config import ModelConfig
    from overlap.models.loading import load_state_dict, read_model_config

    cfg = ModelConfig.from_hf(read_model_config(draft_dir))
    if (cfg.vocab_size, cfg.hidden_size) != (target.cfg.vocab_size, target.cfg.hidden_size):
        raise ValueError(f"draft {draft_dir} does not fit the target: vocab/hidden "
                         f"{cfg.vocab_size}/{cfg.hidden_size} vs {target.cfg.vocab_size}/{target.cfg.hidden_size}")
    sd = load_state_dict(draft_dir, target.dtype)
    vocab_ids = sd.pop("vocab_ids", None)
    model = LlamaModel(cfg, target.dtype, target.embed_tokens.device, shared_embeddings=target,
                       matmul=matmul or target.matmul)
    model.load_hf_state_dict(sd)
    ids = vocab_ids.long().to(target.embed_tokens.device) if vocab_ids is not None else None
    return DraftModel(model.eval(), cfg.vocab_size, ids)
