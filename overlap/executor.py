"""Runs one BatchPlan on the device: prefill chunks and decode steps in one ragged batch.

The step is split the way the pipelined runtime needs it:
  1. prepare  (host)   flatten the plan into input tensors, plan attention;
  2. launch   (device) forward + sampling, no host sync;
  3. collect  (sync)   the one documented sync point: sampled ids to Python ints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.batch import BatchPlan, SeqOutput, StepOutput
from overlap.kv import KVPool
from overlap.models.llama import LlamaModel
from overlap.sampling import SamplingTensors, sample


@dataclass
class PreparedStep:
    plan: BatchPlan
    input_ids: torch.Tensor  # [T] i64
    positions: torch.Tensor  # [T] i64
    meta: Any  # attention metadata for this step
    logits_rows: torch.Tensor  # [S] i64: last row of every sequence that samples
    sample_positions: torch.Tensor  # [S] i64: where each sampled token will sit
    sampling: SamplingTensors | None
    sampled_seq_ids: list[int]


@dataclass
class LaunchedStep:
    prepared: PreparedStep
    tokens: torch.Tensor  # [S] i64 on the device


class Executor:
    def __init__(self, model: LlamaModel, kv: KVPool, backend: AttentionBackend):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = model.embed_tokens.device
        cfg = model.cfg
        self._attn_dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype)

    def execute(self, plan: BatchPlan) -> StepOutput:
        return self.collect(self.launch(self.prepare(plan)))

    # 1. host work
    def prepare(self, plan: BatchPlan) -> PreparedStep:
        ids: list[int] = []
        positions: list[int] = []
        attn: list[SeqAttention] = []
        rows: list[int] = []
        for s in plan.seqs:
            ids += s.token_ids
            positions += range(s.start_pos, s.end_pos)
            attn.append(SeqAttention(q_len=len(s.token_ids), kv_len=s.end_pos, page_table=s.page_table))
            if s.sample:
                rows.append(len(ids) - 1)
        sampled = [s for s in plan.seqs if s.sample]
        dev = self.device
        return PreparedStep(
            plan=plan,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=self.backend.plan(attn, self.kv.page_size, *self._attn_dims),
            logits_rows=torch.tensor(rows, dtype=torch.long, device=dev),
            sample_positions=torch.tensor([s.end_pos for s in sampled], dtype=torch.long, device=dev),
            sampling=SamplingTensors.from_seqs(sampled, dev) if sampled else None,
            sampled_seq_ids=[s.seq_id for s in sampled],
        )

    # 2. device work
    def launch(self, step: PreparedStep) -> LaunchedStep:
        _, logits = self.model(step.input_ids, step.positions, self.backend, self.kv, step.meta,
                               step.logits_rows)
        if step.sampling is None:
            return LaunchedStep(step, torch.empty(0, dtype=torch.long))
        return LaunchedStep(step, sample(logits, step.sampling, step.sample_positions))

    # 3. the sync point
    def collect(self, launched: LaunchedStep) -> StepOutput:
        # The one host sync of a step: the scheduler needs the sampled ids as Python ints.
        tokens = launched.tokens.tolist()
        by_seq = dict(zip(launched.prepared.sampled_seq_ids, tokens))
        plan = launched.prepared.plan
        return StepOutput(plan.step_id, [
            SeqOutput(s.seq_id, [by_seq[s.seq_id]] if s.seq_id in by_seq else []) for s in plan.seqs
        ])
