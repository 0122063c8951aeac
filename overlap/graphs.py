"""CUDA-graph capture and replay of uniform decode-shaped steps, per padded batch-size bucket.

Why: a decode, draft or verify step of a small model is a few hundred tiny kernels, and
launching them one by one from Python costs more host time than the device spends running
them. A CUDA graph records the step's kernels once and replays them with one launch.

What a graph covers: one `GraphRunner` serves steps in which every sequence has exactly
`q_len` new tokens and no tree mask: plain decode and the draft model's single-token steps
(q_len 1), the target's verify pass (q_len k+1). A graph has fixed shapes and fixed device
addresses, so
  * batches are padded up to a bucket size (`bucket_for`): a graph per bucket, not per batch
    size. Padding rows are dummy sequences (`dummy_seq`): token 0 at positions 0..q_len-1,
    kv_len q_len, every page of their page table the caller's scratch page, so their KV
    writes land on a page the scheduler never hands out; their outputs are dropped;
  * inputs live in static buffers: token ids, positions, and everything attention reads
    (page indptr/indices/last-page lengths and the KV write slots), refilled before each
    replay.

Captured: the model forward (embedding, every layer with its KV write and attention `run`,
final norm) into a static hidden-state buffer per bucket. Outside the graph, before each
replay: the attention `plan()` (host scheduling, then async copies into the static
buffers) and the copies of ids/positions into theirs. After it: the logits head on the rows
asked for, one or two ordinary launches (a GEMM and a cast). Captured, the head would need a
static [rows, vocab] f32 output per bucket (a GB or more over the verify buckets of a large
vocabulary) and would compute logits for padding rows. A runner's graphs share one memory
pool (`torch.cuda.graph_pool_handle()`; pass `pool=` to share it across runners) and are
replayed on the current stream, which must be the stream the eager backend runs on: the
graphs' FlashInfer wrappers share its float workspace.

Fallbacks: a batch larger than the largest bucket runs eagerly, unpadded, with the eager
backend. On the CPU, and with a backend that cannot plan into fixed buffers (the reference
backend), the same bucketing and padding run eagerly without capture, so the CPU tests
(tests/test_graphs.py) exercise the padding the graphs replay on CUDA.

The caller provides the KV pool allocated with one page more than the scheduler hands out,
and that page's index as `scratch_page` (the target's and the draft's pools are indexed by
the same page ids, so one index serves both).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.kv import KVPool
from overlap.models.llama import LlamaModel

log = logging.getLogger("overlap.graphs")

# Padded batch sizes with a graph each. Dense at the small end, where most decode batches
# are and padding costs the most relative to the batch; coarser above, where a padded row
# costs little next to reading the weights once.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# Eager runs on a side stream before capture, as PyTorch's CUDA-graph recipe asks: lazy
# initialisation (cuBLAS handles and workspaces, FlashInfer module loads, allocator
# warm-up) must happen outside capture, where device syncs are illegal.
WARMUP_ITERS = 3

Head = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, hidden] → logits [N, vocab] f32


def bucket_for(batch_size: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int | None:
    """The smallest bucket >= batch_size (buckets ascending), or None when the batch is larger
    than every bucket (the caller then runs it eagerly)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    for size in buckets:
        if size >= batch_size:
            return size
    return None


def dummy_seq(q_len: int, page_size: int, scratch_page: int) -> SeqAttention:
    """A padding row: q_len tokens at positions 0..q_len-1 that see only each other, every
    page of its table the scratch page (when q_len exceeds the page size the positions wrap
    onto the same page: harmless for KV that no real sequence reads)."""
    return SeqAttention(q_len, q_len, [scratch_page] * -(-q_len // page_size))


@dataclass
class _Bucket:
    size: int  # padded batch size
    attention: Any  # plans and runs this bucket's attention (the AttentionBackend protocol)
    input_ids: torch.Tensor  # [size * q_len] i64 static input
    positions: torch.Tensor  # [size * q_len] i64 static input
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    hidden: torch.Tensor | None = None  # [size * q_len, hidden] the graph's output buffer


class GraphRunner:
    """Runs uniform steps (B sequences, q_len new tokens each) padded to a bucket: replayed
    CUDA graphs on CUDA with a graph-capable backend, eagerly otherwise.

    model: the LlamaModel to run. kv: its KV pool, one page larger than the scheduler's.
    backend: the eager attention backend: FlashInferBackend on CUDA (each bucket gets its own
      fixed-buffer wrappers from its `graph_attention`), ReferenceBackend on the CPU.
    q_len: new tokens per sequence. scratch_page: the extra page of `kv`.
    buckets: padded batch sizes, ascending. head: hidden [N, hidden] → logits [N, vocab] f32,
      run after the forward on the rows asked for (default model.compute_logits; the draft
      passes DraftModel.logits).
    use_graphs: None = capture when possible, False = never, True = required (raises if not).
    pool: a graph memory pool to share with other runners (default: a new one).
    """

    def __init__(self, model: LlamaModel, kv: KVPool, backend: AttentionBackend, q_len: int, *,
                 scratch_page: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 head: Head | None = None, use_graphs: bool | None = None, pool: Any = None,
                 name: str = "target"):
        if q_len < 1:
            raise ValueError(f"q_len must be >= 1, got {q_len}")
        if not 0 <= scratch_page < kv.num_pages:
            raise ValueError(f"scratch page {scratch_page} is not a page of the pool ({kv.num_pages} pages)")
        buckets = tuple(buckets)
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct positive sizes in ascending order, got {buckets}")
        self.model, self.kv, self.backend, self.q_len = model, kv, backend, q_len
        self.scratch_page, self.buckets, self.name = scratch_page, buckets, name
        self.head = head or model.compute_logits
        self.device = model.embed_tokens.device
        cfg = model.cfg
        self._attn_dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype)
        # Page buffer size per sequence: its longest context or the whole pool, whichever is
        # smaller (and at least a padding row's pages).
        self._pages_per_seq = max(min(-(-cfg.max_position // kv.page_size), kv.num_pages),
                                  -(-q_len // kv.page_size))
        capturable = self.device.type == "cuda" and hasattr(backend, "graph_attention")
        if use_graphs and not capturable:
            raise ValueError("CUDA graphs need a CUDA device and a backend with graph_attention "
                             f"(flashinfer); got {self.device} and {getattr(backend, 'name', backend)!r}")
        self.use_graphs = capturable if use_graphs is None else bool(use_graphs)
        # Why this runner runs its buckets eagerly (None when it captures), for the start-up log.
        self.eager_reason = None if self.use_graphs else (
            "graphs disabled" if use_graphs is False else
            f"no CUDA device ({self.device})" if self.device.type != "cuda" else
            f"the {getattr(backend, 'name', type(backend).__name__)} attention backend cannot be captured")
        self.pool = pool  # a pool handle shared by the caller's runners, else made at first capture
        with torch.inference_mode():
            # [buckets[-1] * q_len] i64: positions 0..q_len-1 of every possible padding row,
            # copied into the tail of a bucket's positions buffer.
            self._dummy_positions = torch.arange(q_len, device=self.device).repeat(buckets[-1])
        self._buckets: dict[int, _Bucket] = {}

    @property
    def captured(self) -> list[int]:
        """Bucket sizes that have a captured graph."""
        return sorted(size for size, b in self._buckets.items() if b.graph is not None)

    def capture_all(self) -> dict:
        """Set up (and on CUDA capture) every bucket now, instead of each on first use. Largest
        first: the smaller captures then reuse the pool memory the larger ones freed.
        Call it at startup: a capture synchronizes the device, and while it runs no other
        thread may use CUDA (capture mode "global" turns a stray allocation into an error).
        Logs and returns what was set up: {name, q_len, buckets, captured, seconds, eager}."""
        t0 = time.perf_counter()
        for size in reversed(self.buckets):
            self._bucket(size)
        report = {"name": self.name, "q_len": self.q_len, "buckets": list(self.buckets),
                  "captured": self.captured, "seconds": time.perf_counter() - t0, "eager": self.eager_reason}
        if self.eager_reason is None:
            log.info("graphs: %s q_len=%d: captured %d buckets %s in %.2f s", self.name, self.q_len,
                     len(report["captured"]), report["captured"], report["seconds"])
        else:
            log.info("graphs: %s q_len=%d: EAGER, not captured (%s); %d buckets padded eagerly, set up in %.2f s",
                     self.name, self.q_len, self.eager_reason, len(self.buckets), report["seconds"])
        return report

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seqs: list[SeqAttention],
                logits_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: len(seqs) sequences of q_len new tokens each, their rows consecutive.

        input_ids, positions: [B * q_len] i64 on the model's device. logits_rows: [R] i64 rows
        of this batch to return logits for, on the device (None: no logits).
        Returns (hidden [B * q_len, hidden], logits [R, vocab] f32 or None), equal to the
        unpadded eager forward's; fresh tensors, safe to keep across later replays.
        """
        b, n = len(seqs), len(seqs) * self.q_len
        if input_ids.shape != (n,) or positions.shape != (n,):
            raise ValueError(f"{b} sequences of q_len {self.q_len} need [{n}] ids and positions, "
                             f"got {tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if any(s.q_len != self.q_len or s.tree_mask is not None for s in seqs):
            raise ValueError(f"this runner runs causal steps of q_len {self.q_len} only")
        size = bucket_for(b, self.buckets)
        with torch.inference_mode():
            if size is None:
                hidden = self._eager(input_ids, positions, seqs)
            else:
                hidden = self._padded(self._bucket(size), input_ids, positions, seqs)
            # Real rows come first in a padded batch: a row of the batch is the same row there.
            return hidden, None if logits_rows is None else self.head(hidden[logits_rows])

    # -- internals -----------------------------------------------------------------------

    def _padded(self, bucket: _Bucket, input_ids: torch.Tensor, positions: torch.Tensor,
                seqs: list[SeqAttention]) -> torch.Tensor:
        """hidden [B * q_len, hidden] of the real rows, from the bucket's graph or body."""
        n = len(seqs) * self.q_len
        # 1. Attention plan (host) for the real rows, then the padding rows.
        pad = [dummy_seq(self.q_len, self.kv.page_size, self.scratch_page)] * (bucket.size - len(seqs))
        meta = bucket.attention.plan(seqs + pad, self.kv.page_size, *self._attn_dims)
        # 2. Inputs into the static buffers. The padding tail is rewritten every time: a
        #    larger batch of the same bucket left its real tokens there.
        bucket.input_ids[:n].copy_(input_ids)
        bucket.input_ids[n:].zero_()
        bucket.positions[:n].copy_(positions)
        bucket.positions[n:].copy_(self._dummy_positions[: bucket.positions.numel() - n])
        # 3. Replay, or run the same body eagerly.
        if bucket.graph is None:
            return self._body(bucket, meta)[:n]
        bucket.graph.replay()
        # A copy, not a view: the next replay of this bucket rewrites the output buffer, which
        # would change a tensor the caller still holds.
        return bucket.hidden[:n].clone()

    def _body(self, bucket: _Bucket, meta: Any) -> torch.Tensor:
        """The captured region: the forward over the static inputs → hidden [size * q_len, hidden]."""
        hidden, _ = self.model(bucket.input_ids, bucket.positions, bucket.attention, self.kv, meta)
        return hidden

    def _eager(self, input_ids: torch.Tensor, positions: torch.Tensor,
               seqs: list[SeqAttention]) -> torch.Tensor:
        """Larger than every bucket: unpadded, with the eager backend → hidden [B * q_len, hidden]."""
        meta = self.backend.plan(seqs, self.kv.page_size, *self._attn_dims)
        hidden, _ = self.model(input_ids, positions, self.backend, self.kv, meta)
        return hidden

    def _bucket(self, size: int) -> _Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            with torch.inference_mode():
                # A graph-capable backend gives each bucket its own fixed-size buffers (what the
                # captured kernels read); any other backend is planned afresh every step.
                attention = (self.backend.graph_attention(size, self.q_len, size * self._pages_per_seq)
                             if hasattr(self.backend, "graph_attention") else self.backend)
                ids = torch.zeros(size * self.q_len, dtype=torch.long, device=self.device)
                bucket = _Bucket(size, attention, ids, torch.zeros_like(ids))
                if self.use_graphs:
                    self._capture(bucket)
            self._buckets[size] = bucket
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        # 1. Something valid to run: every row a padding row, so warm-up and capture write KV
        #    to the scratch page only.
        pad = [dummy_seq(self.q_len, self.kv.page_size, self.scratch_page)] * bucket.size
        meta = bucket.attention.plan(pad, self.kv.page_size, *self._attn_dims)
        bucket.positions.copy_(self._dummy_positions[: bucket.positions.numel()])
        # 2. Warm up on a side stream that first waits for the plan's copies.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_ITERS):
                self._body(bucket, meta)
        torch.cuda.current_stream().wait_stream(side)
        # 3. Capture. The output stays referenced by the bucket for its lifetime: a shared
        #    pool hands memory to later captures only once it is freed, so a live output is
        #    never overwritten by another bucket's graph.
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.hidden = self._body(bucket, meta)
        bucket.graph = graph
