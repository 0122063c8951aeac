"""Runs one BatchPlan on the device: prefill chunks, decode steps and speculative steps.

Each step is split the way the pipelined runtime needs it:
  1. prepare  (host)   flatten the plan into input tensors, plan attention;
  2. launch   (device) draft (speculative steps), target forward, sampling / verification;
  3. collect  (sync)   the one documented sync point: produced ids to Python ints;
  4. catch up (device) the drafter runs over the tokens it has not seen (KV fill).
A decode-only batch in which some sequence asks for drafts is a speculative step; anything
else (prefill chunks, mixed batches) samples one token per finishing sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.batch import BatchPlan, SeqOutput, SeqWork, StepOutput
from overlap.kv import KVPool
from overlap.models.llama import LlamaModel
from overlap.sampling import SamplingTensors, probabilities, sample
from overlap.spec.base import CatchUp, Proposal, Proposer
from overlap.spec.rejection import verify_chain


@dataclass
class PreparedStep:
    plan: BatchPlan
    input_ids: torch.Tensor  # [T] i64
    positions: torch.Tensor  # [T] i64
    meta: Any  # attention metadata for this step
    logits_rows: torch.Tensor  # [S] i64: last row of every sequence that samples
    sampled: list[SeqWork]  # sequences that produce tokens, in logits_rows order
    sampling: SamplingTensors | None
    spec_ks: list[int] | None  # drafts per sequence on a speculative step, else None
    proposal: Proposal | None  # made on the host during prepare (host drafters)


@dataclass
class LaunchedStep:
    prepared: PreparedStep
    tokens: torch.Tensor  # [S, K+1] i64 produced tokens (padding past num_produced)
    num_accepted: torch.Tensor | None  # [S] i64 on speculative steps
    num_drafts: list[int]


class Executor:
    def __init__(self, model: LlamaModel, kv: KVPool, backend: AttentionBackend,
                 proposer: Proposer | None = None):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.proposer = proposer
        self.device = model.embed_tokens.device
        cfg = model.cfg
        self._attn_dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype)

    def execute(self, plan: BatchPlan) -> StepOutput:
        launched = self.launch(self.prepare(plan))
        output = self.collect(launched)
        self.catch_up(launched.prepared.plan, output)
        return output

    # 1. host work
    def prepare(self, plan: BatchPlan) -> PreparedStep:
        if self.proposer is not None and plan.freed_seq_ids:
            self.proposer.release(plan.freed_seq_ids)
        sampled = [s for s in plan.seqs if s.sample]
        dev = self.device
        sampling = SamplingTensors.from_seqs(sampled, dev) if sampled else None
        spec = self.proposer is not None and plan.is_decode_only and any(s.num_spec_tokens for s in plan.seqs)
        ks = [s.num_spec_tokens for s in plan.seqs] if spec else [0] * len(plan.seqs)
        proposal = None
        if spec and self.proposer.on_host:  # on_host proposers fill Proposal.host_tokens
            # Host drafters (n-gram) propose now, so the verify pass is sized to the drafts
            # they actually found, and a step where none are found is a plain decode.
            proposal = self.proposer.propose(plan.seqs, ks, sampling)
            ks = proposal.num_drafts
            spec = any(ks)
        ids: list[int] = []
        positions: list[int] = []
        attn: list[SeqAttention] = []
        rows: list[int] = []
        for i, s in enumerate(plan.seqs):
            # On a speculative step each sequence's verify rows are [last token, drafts...];
            # device drafters' tokens are filled in by launch().
            drafts = proposal.host_tokens[i] if proposal is not None else [0] * ks[i]
            q_len = len(s.token_ids) + ks[i]
            ids += s.token_ids + drafts
            positions += range(s.start_pos, s.start_pos + q_len)
            attn.append(SeqAttention(q_len=q_len, kv_len=s.start_pos + q_len, page_table=s.page_table))
            if s.sample:
                rows += range(len(ids) - q_len, len(ids)) if spec else [len(ids) - 1]
        return PreparedStep(
            plan=plan,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=self.backend.plan(attn, self.kv.page_size, *self._attn_dims),
            logits_rows=torch.tensor(rows, dtype=torch.long, device=dev),
            sampled=sampled,
            sampling=sampling,
            spec_ks=ks if spec else None,
            proposal=proposal if spec else None,
        )

    # 2. device work
    def launch(self, step: PreparedStep) -> LaunchedStep:
        if step.spec_ks is not None:
            return self._launch_speculative(step)
        _, logits = self.model(step.input_ids, step.positions, self.backend, self.kv, step.meta,
                               step.logits_rows)
        if step.sampling is None:
            return LaunchedStep(step, torch.empty(0, 1, dtype=torch.long), None, [])
        positions = torch.tensor([s.end_pos for s in step.sampled], dtype=torch.long, device=self.device)
        return LaunchedStep(step, sample(logits, step.sampling, positions)[:, None], None, [])

    def _launch_speculative(self, step: PreparedStep) -> LaunchedStep:
        seqs, ks, st = step.sampled, step.spec_ks, step.sampling
        b, dev = len(seqs), self.device
        # Stage 2: draft (host drafters already did, in prepare).
        proposal = step.proposal or self.proposer.propose(seqs, ks, st)
        width = proposal.tokens.shape[1]
        # Where each row of the flat verify batch goes in the padded [B, K+1] layout.
        flat_draft, padded_all, padded_draft = [], [], []
        row = 0
        for i, k in enumerate(ks):
            flat_draft += range(row + 1, row + 1 + k)
            padded_draft += range(i * width, i * width + k)
            padded_all += range(i * (width + 1), i * (width + 1) + k + 1)
            row += k + 1
        ids = step.input_ids
        if step.proposal is None:
            ids = ids.clone()
            ids[torch.tensor(flat_draft, dtype=torch.long, device=dev)] = \
                proposal.tokens.view(-1)[torch.tensor(padded_draft, dtype=torch.long, device=dev)]
        # Stage 3: verify all drafts in one target pass (q_len = k+1 per sequence).
        _, logits = self.model(ids, step.positions, self.backend, self.kv, step.meta, step.logits_rows)
        padded = torch.zeros(b * (width + 1), logits.shape[-1], device=dev)
        padded[torch.tensor(padded_all, dtype=torch.long, device=dev)] = logits
        rows_st = SamplingTensors.from_seqs(seqs, dev, repeats=[width + 1] * b)
        p = probabilities(padded, rows_st).view(b, width + 1, -1)
        # Drafters may find fewer drafts than reserved (n-gram); verify what they proposed.
        num_drafts = torch.tensor(proposal.num_drafts, dtype=torch.long, device=dev)
        first = torch.tensor([s.end_pos for s in seqs], dtype=torch.long, device=dev)
        # Stage 4 (recovered / bonus token) happens inside verify_chain.
        tokens, accepted = verify_chain(p, proposal.probs, proposal.tokens, num_drafts, st.seed, first)
        return LaunchedStep(step, tokens, accepted, proposal.num_drafts)

    # 3. the sync point
    def collect(self, launched: LaunchedStep) -> StepOutput:
        # The one host sync of a step: the scheduler needs the produced ids as Python ints.
        tokens = launched.tokens.tolist()
        accepted = launched.num_accepted.tolist() if launched.num_accepted is not None else None
        outputs: dict[int, SeqOutput] = {}
        for i, s in enumerate(launched.prepared.sampled):
            if accepted is None:
                outputs[s.seq_id] = SeqOutput(s.seq_id, tokens[i][:1])
            else:
                a = accepted[i]
                outputs[s.seq_id] = SeqOutput(s.seq_id, tokens[i][: a + 1], launched.num_drafts[i], a)
        plan = launched.prepared.plan
        return StepOutput(plan.step_id, [outputs.get(s.seq_id, SeqOutput(s.seq_id, [])) for s in plan.seqs])

    # 4. drafter KV fill
    def catch_up(self, plan: BatchPlan, output: StepOutput) -> None:
        """Feed the drafter the tokens it has not seen: prompt chunks and produced tokens."""
        if self.proposer is None:
            return
        updates = []
        for s, out in zip(plan.seqs, output.seqs):
            if not s.draft:
                continue
            known = s.token_ids + out.token_ids  # from position s.start_pos on
            skip = 0
            if out.num_drafts:
                # The drafter ran its own drafts 1..k-1 through its KV while proposing; the
                # accepted ones are valid there. Feed from the first token it has not run:
                # the recovered token, or the last draft (if all were accepted) + the bonus.
                skip = 1 + min(out.num_accepted, out.num_drafts - 1)
            # Elsewhere the step's input token is fed again (an identical KV rewrite) so that
            # prefill chunks, plain decodes and recomputes after preemption share one rule.
            updates.append(CatchUp(s.seq_id, s.start_pos + skip, known[skip:], s.page_table))
        self.proposer.catch_up(updates)
