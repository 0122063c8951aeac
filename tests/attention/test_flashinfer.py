"""FlashInfer attention equals the reference backend on random ragged paged batches.

The GPU tests are marked `gpu` and skipped without CUDA (or without flashinfer). The CPU
tests need neither: they check that the shared batch builder's oracle agrees with the
reference backend, and run the backend's plan() against torch stand-ins for FlashInfer's
wrappers that read indptr/indices/last_page_len and the packed mask the way its kernels do,
so host-side bugs (page counts, last-page lengths, mask bits and offsets, slots) fail in CI.
"""

import random

import numpy as np
import pytest
import torch

from helpers import flashinfer_on_fakes
from overlap.attention import ReferenceBackend, SeqAttention
from attention_oracle import (KINDS, dense_attention, max_abs_error, random_paged_batch,
                                       random_specs, step_mask)

PAGE_SIZES = [1, 16, 5]
DTYPES = [torch.bfloat16, torch.float16]
TOL = 2e-2

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batch(kind, page_size, dtype, seed, device="cpu"):
    specs = random_specs(kind, random.Random(seed))
    return random_paged_batch(specs, page_size, dtype=dtype, device=device, seed=seed)


def _run(backend, batch):
    return backend.run(batch.layer, batch.q, batch.pool, batch.plan(backend))


# -- CPU: the oracle and the mask layout ---------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_reference_matches_dense_oracle(kind, page_size):
    batch = _batch(kind, page_size, torch.float32, seed=page_size)
    out = _run(ReferenceBackend(), batch)
    assert max_abs_error(out, batch.expected) < 1e-5


def test_batch_kinds_have_their_shape():
    rng = random.Random(0)
    for _ in range(20):
        assert all(s.new == 1 and not s.tree for s in random_specs("decode", rng))
        assert all(s.new == 5 and s.cached >= 1 for s in random_specs("verify", rng))
        assert any(s.new > 1 for s in random_specs("mixed", rng))
        assert any(s.tree for s in random_specs("tree", rng))


# -- CPU: what plan() hands FlashInfer describes the batch ---------------------------------

class _FakeWrapper:
    """Torch stand-in for FlashInfer's paged wrappers, per the 0.7.4 source: KV length from
    indptr and last_page_len; causal aligned bottom-right; a packed mask read at byte offset
    mask_indptr[b], which plan() leaves in mask *bits* (the bug the backend corrects)."""

    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self._mask_indptr_buf = None

    def _plan(self, qo_indptr, kv_indptr, indices, last, page_size, dtype, causal, packed):
        for t in (qo_indptr, kv_indptr, indices, last):
            assert t.dtype == torch.int32 and t.device.type == "cpu"  # host inputs, no sync
        self.qo, self.kv, self.indices, self.last = (t.tolist() for t in (qo_indptr, kv_indptr, indices, last))
        self.page_size, self.dtype, self.causal, self.packed = page_size, dtype, causal, packed
        if packed is not None:
            lens = [(self.qo[b + 1] - self.qo[b]) * self._kv_len(b) for b in range(len(last))]
            self._mask_indptr_buf = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)

    def _kv_len(self, b):
        return (self.kv[b + 1] - self.kv[b] - 1) * self.page_size + self.last[b]

    def run(self, q, paged_kv_cache, out):
        assert q.dtype == self.dtype and out.shape == q.shape
        k_cache, v_cache = paged_kv_cache
        for b in range(len(self.last)):
            pages, kv_len = self.indices[self.kv[b]: self.kv[b + 1]], self._kv_len(b)
            k = k_cache[pages].flatten(0, 1)[:kv_len]
            v = v_cache[pages].flatten(0, 1)[:kv_len]
            rows = slice(self.qo[b], self.qo[b + 1])
            q_len = rows.stop - rows.start
            mask = torch.ones(q_len, kv_len, dtype=torch.bool)
            if self.packed is not None:
                base = int(self._mask_indptr_buf[b])
                bits = np.unpackbits(self.packed.numpy()[base:], bitorder="little")[: q_len * kv_len]
                mask = torch.from_numpy(bits.astype(bool)).view(q_len, kv_len)
            elif self.causal:
                mask = step_mask(q_len, kv_len, None)
            out[rows] = dense_attention(q[rows], k, v, mask).to(out.dtype)
        return out


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             q_data_type, kv_data_type):
        self._plan(torch.arange(len(last) + 1, dtype=torch.int32), indptr, indices, last,
                   page_size, q_data_type, False, None)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, kv_indptr, indices, last, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, causal, q_data_type, kv_data_type, packed_custom_mask=None):
        self._plan(qo_indptr, kv_indptr, indices, last, page_size, q_data_type, causal,
                   packed_custom_mask)


@pytest.fixture
def fake_backend_module(monkeypatch):
    """overlap.attention.flashinfer loaded under another name against the fakes (the real
    module and sys.modules stay untouched), with unpinned host tensors (CPU-only torch)."""
    return flashinfer_on_fakes(monkeypatch, _FakeDecode, _FakePrefill, "_flashinfer_backend_on_fakes")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_plan_describes_the_batch(fake_backend_module, kind, page_size):
    backend = fake_backend_module.FlashInferBackend("cpu")
    for seed in range(2):
        batch = _batch(kind, page_size, torch.bfloat16, seed)
        meta = batch.plan(backend)
        assert isinstance(meta.wrapper, _FakeDecode if kind == "decode" else _FakePrefill)
        assert torch.equal(meta.slots, batch.plan(ReferenceBackend()).slots)
        out = backend.run(batch.layer, batch.q, batch.pool, meta)
        assert max_abs_error(out, batch.expected) < TOL


def test_stale_metadata_is_refused(fake_backend_module):
    backend = fake_backend_module.FlashInferBackend("cpu")
    batch = _batch("mixed", 16, torch.bfloat16, seed=1)
    metas = [batch.plan(backend) for _ in range(fake_backend_module.PLAN_SLOTS + 1)]
    backend.run(batch.layer, batch.q, batch.pool, metas[-1])
    with pytest.raises(RuntimeError, match="stale"):
        backend.run(batch.layer, batch.q, batch.pool, metas[0])


def test_packed_mask_layout_is_what_the_kernel_reads(fake_backend_module):
    """Kernel (variants.cuh): bit = (mask[indptr[b] + off // 8] >> (off % 8)) & 1 with
    off = qo * kv_len + kv, indptr[b] in bytes."""
    pack_custom_mask = fake_backend_module.pack_custom_mask
    batch = _batch("tree", 5, torch.bfloat16, seed=3)
    batch.seqs.append(SeqAttention(3, 11, [0, 1, 2]))  # causal rows in a masked step
    packed, indptr = pack_custom_mask(batch.seqs)
    assert indptr[-1] == packed.size
    for b, s in enumerate(batch.seqs):
        want = step_mask(s.q_len, s.kv_len, s.tree_mask)
        got = torch.zeros_like(want)
        for qo in range(s.q_len):
            for kv in range(s.kv_len):
                off = qo * s.kv_len + kv
                got[qo, kv] = bool((packed[indptr[b] + off // 8] >> (off % 8)) & 1)
        assert torch.equal(got, want), f"sequence {b}"


# -- GPU: FlashInfer against the reference --------------------------------------------------

@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_flashinfer_matches_reference(kind, page_size, dtype):
    pytest.importorskip("flashinfer")
    from overlap.attention.flashinfer import FlashInferBackend

    backend = FlashInferBackend("cuda")
    for seed in range(3):
        batch = _batch(kind, page_size, dtype, seed, device="cuda")
        out = _run(backend, batch)
        torch.cuda.synchronize()
        assert out.dtype == dtype and out.shape == batch.q.shape
        ref = _run(ReferenceBackend(), _batch(kind, page_size, dtype, seed))  # same batch, on the CPU
        assert max_abs_error(ref, batch.expected) < TOL  # the oracle itself is consistent
        err = max_abs_error(out, ref)
        assert err < TOL, f"{kind} page_size={page_size} seed={seed}: max abs error {err:.4f}"


@gpu
@needs_cuda
def test_flashinfer_slots_and_stale_metadata():
    pytest.importorskip("flashinfer")
    from overlap.attention.flashinfer import PLAN_SLOTS, FlashInferBackend

    backend = FlashInferBackend("cuda")
    batch = _batch("mixed", 5, torch.bfloat16, seed=7, device="cuda")
    ref_meta = batch.plan(ReferenceBackend())
    metas = [batch.plan(backend) for _ in range(PLAN_SLOTS + 1)]
    assert torch.equal(metas[0].slots.cpu(), ref_meta.slots)
    assert metas[-1].slots.dtype == torch.long and metas[-1].slots.device.type == "cuda"
    _run(backend, batch)  # a fresh plan runs ...
    with pytest.raises(RuntimeError, match="stale"):  # ... one planned over does not
        backend.run(batch.layer, batch.q, batch.pool, metas[0])
