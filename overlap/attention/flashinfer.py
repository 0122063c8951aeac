"""FlashInfer paged attention for CUDA: the same protocol as the reference backend.

`plan` does all host work of a step once: page indptr/indices/last-page lengths as int32
arrays in pinned host memory, the flat KV slots of the new tokens, and the wrapper's own
`plan()`, which runs FlashInfer's scheduler on the CPU and copies its work split to the
device without waiting for it. That is the work the runtime hides under the previous
step's forward. Every layer's `run` then only launches kernels against the pool's
per-layer (k, v) caches, [num_pages, page_size, kv_heads, head_dim] each (NHD, as KVPool).

Which FlashInfer wrapper runs a step:
  * every sequence has q_len 1 and no tree mask  -> BatchDecodeWithPagedKVCacheWrapper;
  * otherwise                                    -> BatchPrefillWithPagedKVCacheWrapper,
      causal=True (bottom-right aligned: query i of a sequence sees the cached prefix and
      new tokens 0..i), or a custom mask when any sequence carries a tree mask.

FlashInfer's custom mask covers each request's FULL [q_len, kv_len] score matrix, not just
the new tokens: row-major, requests concatenated, one bit per (query, key) pair. So every
sequence of a masked step gets a mask: the cached-prefix columns all True, the last q_len
columns its tree mask (or a lower triangle for causal rows). We pack it on the host.

CUDA graphs (overlap/graphs.py) get their attention from `graph_attention()`: wrappers built
with use_cuda_graph=True over buffers of fixed size, one set per captured batch shape. A
graph's q_len is uniform, and FlashInfer is told so: q_len 1 runs the decode wrapper; q_len
k+1 runs the decode wrapper on its tensor-core path planned with `q_len_per_req=q_len`
(FlashInfer passes it to its scheduler as `uniform_q_len`), causal within each request. A
graph-mode PREFILL wrapper would size its query tiles for the ragged worst case of the
buffer (total rows - batch + 1 rows in one request: 128-row tiles for 15 real rows).

Only imported from `make_backend` when the device is CUDA; the CPU path never needs
flashinfer installed. Written against flashinfer-python 0.7.4 (its private
`_mask_indptr_buf` and the graph-mode `q_len_per_req` plan): `check_flashinfer_version`
refuses versions outside SUPPORTED_VERSIONS with a message saying what to install.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import re

import flashinfer
import numpy as np
import torch

from overlap.attention.base import SeqAttention
from overlap.kv import KVPool, slot_mapping

# FlashInfer's recommended float workspace (split-k partial results), shared by all wrappers.
WORKSPACE_BYTES = 128 * 1024 * 1024
# Wrapper sets used round-robin: a wrapper holds its last plan, so planning step N+1 into
# the wrappers step N still runs on would silently change N's attention. With two sets,
# step N's metadata stays valid while N+1 is planned (the pipelined runtime plans one step
# ahead); a third plan reuses N's set, and `run` then refuses N's stale metadata.
PLAN_SLOTS = 2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# [lowest, first unsupported): the range this module was checked against (pyproject's `gpu` extra).
SUPPORTED_VERSIONS = ((0, 7, 4), (0, 8, 0))


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(x or 0) for x in match.groups()) if match else ()


def check_flashinfer_version(version: str | None = None) -> str:
    """The installed flashinfer's version, or RuntimeError naming the supported range."""
    version = version if version is not None else getattr(flashinfer, "__version__", "unknown")
    low, high = SUPPORTED_VERSIONS
    have = _version_tuple(version)
    if not (low <= have < high):
        want = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        raise RuntimeError(f"flashinfer-python {version} is installed; overlap's flashinfer backend was "
                           f"checked against flashinfer-python{want} (it relies on that version's wrapper "
                           f"internals): pip install 'flashinfer-python{want}', or run --attention-backend "
                           f"torch")
    return version


try:  # at import: a wrong flashinfer fails here, with what to install, not mid-step
    FLASHINFER_VERSION = check_flashinfer_version()
except RuntimeError as _exc:
    raise ImportError(str(_exc)) from None


@dataclass(frozen=True)
class FlashInferMetadata:
    slots: torch.Tensor  # [T] i64 on the device: page * page_size + offset of each new token
    wrapper: Any  # the planned decode or prefill wrapper; None for an empty step
    slot_index: int  # which wrapper set was planned ...
    plan_id: int  # ... by which plan() call (stale-metadata check)
    # Pinned host sources of the plan's non_blocking copies. Kept alive with the metadata
    # so their memory cannot be reused and rewritten before the copies have run.
    host: tuple[torch.Tensor, ...]


class _WrapperSet:
    def __init__(self, workspace: torch.Tensor):
        # One float workspace for every set: runs of different plans are serialized on the
        # forward stream, so they never use it at the same time. Each wrapper owns its int
        # workspace (and pinned staging copy) where plan() writes the schedule.
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        self.plan_id = -1
        self.copied: torch.cuda.Event | None = None  # fires when this set's last plan was copied

    def reuse(self) -> None:
        """Wait until the device has run the copies of this set's previous plan. plan() stages
        its schedule in the wrapper's one pinned host buffer and copies it non_blocking: if
        the device lags PLAN_SLOTS plans behind (the draft plans k-1 steps in a row), a new
        plan would overwrite that buffer before the old copy has read it. A host wait only
        in that case; normally the event fired long ago."""
        if self.copied is not None:
            self.copied.synchronize()

    def planned(self, device: torch.device) -> None:
        if device.type == "cuda":  # (the CPU tests drive the planning with fake wrappers)
            self.copied = torch.cuda.Event()
            self.copied.record()


class FlashInferBackend:
    """Paged attention through FlashInfer. plan() and run() must be issued on the same CUDA
    stream: plan() enqueues the copies of the schedule that run()'s kernels read."""

    name = "flashinfer"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        # Allocated once: a 128 MB cudaMalloc per step would cost more than the plan itself.
        # FlashInfer requires the float workspace zeroed before its first use.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._sets = [_WrapperSet(self._workspace) for _ in range(PLAN_SLOTS)]
        self._plans = 0

    def plan(self, seqs: list[SeqAttention], page_size: int, num_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> FlashInferMetadata:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"flashinfer attention runs fp16/bf16 models, not {dtype}")
        # 1. Host arrays: page indptr/indices/last-page fill, query indptr, slots.
        qo_indptr, kv_indptr, indices, last_len, slots = page_arrays(seqs, page_size)
        slots_h = _pinned(slots, torch.long)
        slot_dev = slots_h.to(self.device, non_blocking=True)
        slot_index = self._plans % PLAN_SLOTS
        wset = self._sets[slot_index]
        wset.plan_id = self._plans
        self._plans += 1
        if not seqs:
            return FlashInferMetadata(slot_dev, None, slot_index, wset.plan_id, (slots_h,))
        wset.reuse()
        meta = self._plan_wrappers(wset, seqs, qo_indptr, kv_indptr, indices, last_len, slots_h, slot_dev,
                                   slot_index, page_size, num_heads, num_kv_heads, head_dim, dtype)
        wset.planned(self.device)
        return meta

    def _plan_wrappers(self, wset: _WrapperSet, seqs, qo_indptr, kv_indptr, indices, last_len, slots_h,
                       slot_dev, slot_index, page_size, num_heads, num_kv_heads, head_dim, dtype):

        # 2. Host tensors, not device ones: plan() reads indptr and lengths on the host to
        #    build its schedule (device inputs would cost a device-to-host sync), then copies
        #    them to the device itself, non_blocking from pinned memory.
        kv_indptr_h, indices_h, last_h = (_pinned(a, torch.int32) for a in (kv_indptr, indices, last_len))
        dims = (num_heads, num_kv_heads, head_dim, page_size)
        types = dict(q_data_type=dtype, kv_data_type=dtype)
        host: tuple[torch.Tensor, ...] = (slots_h, kv_indptr_h, indices_h, last_h)
        if all(s.q_len == 1 and s.tree_mask is None for s in seqs):
            wset.decode.plan(kv_indptr_h, indices_h, last_h, *dims, **types)
            return FlashInferMetadata(slot_dev, wset.decode, slot_index, wset.plan_id, host)

        # 3. Prefill wrapper: causal, or the full-length custom mask when any tree is present.
        qo_indptr_h = _pinned(qo_indptr, torch.int32)
        host += (qo_indptr_h,)
        if not any(s.tree_mask is not None for s in seqs):
            wset.prefill.plan(qo_indptr_h, kv_indptr_h, indices_h, last_h, *dims,
                              causal=True, **types)
        else:
            packed, mask_indptr = pack_custom_mask(seqs)
            packed_h, mask_indptr_h = _pinned(packed, torch.uint8), _pinned(mask_indptr, torch.int32)
            host += (packed_h, mask_indptr_h)
            # A packed mask, not a bool one: given `custom_mask`, plan() packs it on the GPU
            # and reads the packed length back with .item(), a device sync in the middle of
            # planning that would stall the CPU until the step in flight finishes.
            wset.prefill.plan(qo_indptr_h, kv_indptr_h, indices_h, last_h, *dims,
                              packed_custom_mask=packed_h, causal=False, **types)
            # Given a packed mask, FlashInfer 0.7.4's plan() keeps mask_indptr in mask BITS,
            # but the kernel adds it to a uint8 pointer (variants.cuh: custom_mask_ptr =
            # maybe_custom_mask + maybe_mask_indptr[batch_idx]): every request after the first
            # would read another request's bits (flashinfer PR #2201). Install byte offsets.
            if not hasattr(wset.prefill, "_mask_indptr_buf"):
                raise RuntimeError("flashinfer's prefill wrapper changed: re-check the mask_indptr fix")
            wset.prefill._mask_indptr_buf = mask_indptr_h.to(self.device, non_blocking=True)
        return FlashInferMetadata(slot_dev, wset.prefill, slot_index, wset.plan_id, host)

    def run(self, layer: int, q: torch.Tensor, kv: KVPool, meta: FlashInferMetadata) -> torch.Tensor:
        """q [T, H, D] fp16/bf16 → [T, H, D] in q's dtype."""
        out = torch.empty_like(q)  # passed in: the wrappers would otherwise zero-fill a new one
        if meta.wrapper is None:
            return out
        if self._sets[meta.slot_index].plan_id != meta.plan_id:
            raise RuntimeError(f"stale attention metadata (plan {meta.plan_id}): its wrappers "
                               f"were re-planned; at most {PLAN_SLOTS} plans may be live")
        return meta.wrapper.run(q.contiguous(), (kv.k[layer], kv.v[layer]), out=out)

    def graph_attention(self, batch_size: int, q_len: int, max_pages: int) -> FlashInferGraphAttention:
        """Attention for one CUDA graph (overlap/graphs.py): exactly `batch_size` sequences of
        `q_len` new tokens, at most `max_pages` KV pages over all of them. It shares this
        backend's float workspace, so its replays must be serialized with this backend's
        runs (one stream)."""
        return FlashInferGraphAttention(self._workspace, batch_size, q_len, max_pages)


@dataclass(frozen=True)
class FlashInferGraphMetadata:
    slots: torch.Tensor  # [B * q_len] i64 on the device: the graph's static slot buffer
    host: tuple[torch.Tensor, ...]  # pinned sources of the plan's copies (kept alive)


class FlashInferGraphAttention:
    """The attention backend of one captured CUDA graph: a fixed batch of `batch_size`
    sequences with exactly `q_len` new tokens each, causal, no tree masks.

    A captured graph replays fixed device addresses, so everything its kernels read lives
    in buffers allocated here once: the page indptr/indices/last-page lengths (and query
    indptr) handed to FlashInfer's wrappers built with use_cuda_graph=True, and the KV
    write slots read by the captured `kv.write`. `plan()` runs outside the graph before
    every replay and refills them (FlashInfer's plan() copies into its buffers in graph
    mode); `run()` is what gets captured. q_len 1 runs the decode wrapper, longer q_len
    the causal prefill wrapper: the same kernels as FlashInferBackend picks eagerly.
    """

    name = "flashinfer-graph"

    def __init__(self, workspace: torch.Tensor, batch_size: int, q_len: int, max_pages: int):
        dev = workspace.device
        self.batch_size, self.q_len = batch_size, q_len
        i32 = dict(dtype=torch.int32, device=dev)
        self._kv_indptr = torch.zeros(batch_size + 1, **i32)  # [B+1] i32
        self._indices = torch.zeros(max_pages, **i32)  # [max_pages] i32, a prefix used per plan
        self._last_len = torch.zeros(batch_size, **i32)  # [B] i32
        # [B * q_len] i64: where the captured kv.write stores the new K/V.
        self.slots = torch.zeros(batch_size * q_len, dtype=torch.long, device=dev)
        buffers = dict(paged_kv_indptr_buffer=self._kv_indptr, paged_kv_indices_buffer=self._indices,
                       paged_kv_last_page_len_buffer=self._last_len)
        # q_len > 1: the tensor-core decode path, planned with q_len_per_req (FlashInfer's
        # uniform_q_len), so its tiles fit q_len rows per request, not the ragged worst case.
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=q_len > 1, **buffers)
        self._uniform = dict(q_len_per_req=q_len) if q_len > 1 else {}
        self._copied: torch.cuda.Event | None = None  # recorded after the last plan's copies

    def plan(self, seqs: list[SeqAttention], page_size: int, num_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> FlashInferGraphMetadata:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"flashinfer attention runs fp16/bf16 models, not {dtype}")
        if len(seqs) != self.batch_size:
            raise ValueError(f"graph attention is planned for {self.batch_size} sequences, got {len(seqs)}")
        if any(s.q_len != self.q_len or s.tree_mask is not None for s in seqs):
            raise ValueError(f"graph attention runs causal steps of q_len {self.q_len} only")
        _, kv_indptr, indices, last_len, slots = page_arrays(seqs, page_size)
        if len(indices) > self._indices.numel():
            raise ValueError(f"{len(indices)} KV pages exceed the graph's buffer of {self._indices.numel()}")
        if self._copied is not None:
            # FlashInfer's plan() stages its work split in ONE pinned host buffer per wrapper
            # and copies it to the device asynchronously. Re-planning before that copy has
            # run would rewrite its source: the previous replay would read this plan's
            # schedule. Wait for it; that copy precedes the previous replay on the stream, so
            # this only blocks a host running more than one step ahead of the device.
            self._copied.synchronize()
        kv_indptr_h, indices_h, last_h = (_pinned(a, torch.int32) for a in (kv_indptr, indices, last_len))
        slots_h = _pinned(slots, torch.long)
        # Indices go to the device first: in graph mode plan() copies host indices into its
        # buffer with a BLOCKING copy (non_blocking only when they are already on the
        # device), which would wait for every step queued on the stream.
        indices_d = indices_h.to(self.slots.device, non_blocking=True)
        dims = (num_heads, num_kv_heads, head_dim, page_size)
        types = dict(q_data_type=dtype, kv_data_type=dtype)
        self._wrapper.plan(kv_indptr_h, indices_d, last_h, *dims, **self._uniform, **types)
        self.slots.copy_(slots_h, non_blocking=True)
        if self.slots.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return FlashInferGraphMetadata(self.slots, (kv_indptr_h, indices_h, last_h, slots_h))

    def run(self, layer: int, q: torch.Tensor, kv: KVPool, meta: FlashInferGraphMetadata) -> torch.Tensor:
        """q [B * q_len, H, D] fp16/bf16 → [B * q_len, H, D]; captured into the graph."""
        out = torch.empty_like(q)
        return self._wrapper.run(q.contiguous(), (kv.k[layer], kv.v[layer]), out=out)


def page_arrays(seqs: list[SeqAttention], page_size: int
                ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Host lists (qo_indptr [B+1], kv_indptr [B+1], page indices, last_page_len [B], slots [T])
    describing a step the way FlashInfer's paged wrappers read it. Only the pages covered by
    kv_len are listed: a page table may hold pages reserved for later tokens, and FlashInfer
    must not see them."""
    qo_indptr, kv_indptr, indices, last_len, slots = [0], [0], [], [], []
    for s in seqs:
        n_pages = -(-s.kv_len // page_size)
        if s.q_len < 1 or s.kv_len < s.q_len or len(s.page_table) < n_pages:
            raise ValueError(f"bad sequence for page size {page_size}: {s}")
        indices += s.page_table[:n_pages]
        kv_indptr.append(len(indices))
        last_len.append(s.kv_len - (n_pages - 1) * page_size)  # 1..page_size
        qo_indptr.append(qo_indptr[-1] + s.q_len)
        slots += slot_mapping(s.page_table, s.kv_len - s.q_len, s.kv_len, page_size)
    return qo_indptr, kv_indptr, indices, last_len, slots


def pack_custom_mask(seqs: list[SeqAttention]) -> tuple[np.ndarray, np.ndarray]:
    """Bit-pack every sequence's [q_len, kv_len] mask the way FlashInfer's kernel reads it.

    Returns (packed [sum ceil(q*kv/8)] u8, byte indptr [B+1] i32). Within a request, pair
    (i, j) is bit i * kv_len + j, bit order little (bit b of byte n is element 8n + b);
    each request starts on a byte boundary, like flashinfer.segment_packbits(bitorder="little").
    Causal sequences get a lower triangle; the cached prefix is always visible.
    """
    parts, indptr = [], [0]
    for s in seqs:
        mask = np.ones((s.q_len, s.kv_len), dtype=bool)
        if s.tree_mask is not None:
            # Host tensor (built by the planner); a device one would sync here.
            mask[:, s.kv_len - s.q_len:] = s.tree_mask.numpy()
        else:
            mask[:, s.kv_len - s.q_len:] = np.tri(s.q_len, dtype=bool)
        packed = np.packbits(mask.reshape(-1), bitorder="little")
        parts.append(packed)
        indptr.append(indptr[-1] + packed.size)
    return np.concatenate(parts), np.asarray(indptr, dtype=np.int32)


def _pinned(values, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor: a non_blocking copy from pageable memory is staged
    synchronously by the driver, pinned memory lets it run on the stream, unwaited.
    Via numpy: converting a long Python list is ~4x faster there than in torch.tensor."""
    array = np.asarray(values, dtype=_NP_DTYPES[dtype])
    return torch.from_numpy(array).pin_memory()


_NP_DTYPES = {torch.int32: np.int32, torch.long: np.int64, torch.uint8: np.uint8}
