"""Bucketed, padded steps (overlap/graphs.py) equal the unpadded eager forward.

On the CPU nothing is captured, but the runner pads, plans and runs exactly what a graph
replays: the tests check that padding rows change neither the real rows' hidden states and
logits nor any KV but the scratch page's, for decode (q_len 1) and verify (q_len 5) shapes,
batches that fill a bucket, need padding, or exceed every bucket (eager fallback).
The FlashInfer graph attention's fixed-buffer planning runs against torch stand-ins for
FlashInfer's wrappers in CUDA-graph mode, which read only the buffers handed to their
constructor, as the captured kernels do. Graph capture itself is checked by the GPU test
below and by tools/gpu_check.py (section `graphs`).
"""

import random

import pytest
import torch

from helpers import flashinfer_on_fakes
from overlap.attention import ReferenceBackend, SeqAttention
from attention_oracle import dense_attention, step_mask
from overlap.config import ModelConfig
from overlap.graphs import DEFAULT_BUCKETS, GraphRunner, bucket_for, dummy_seq
from overlap.models.llama import LlamaModel

PAGE = 4
NUM_PAGES = 64  # the scheduler's pages; the pool has one more, the scratch page
SCRATCH = NUM_PAGES
BUCKETS = (1, 2, 4, 8)
# Batch sizes in one runner's life: exact bucket, padded, smaller batch after a larger one in
# the same bucket (stale padding tail), larger than every bucket (eager), bucket 1.
STEPS = [4, 3, 8, 5, 11, 2, 1]


def tiny_model(dtype=torch.bfloat16, seed=0, head_dim=16, device="cpu") -> LlamaModel:
    """bfloat16 by default: on the CPU our linear layers are batch-invariant in bf16 only
    (models/llama.py, ROW_BLOCK), so padded and unpadded runs can be compared bit for bit;
    float32 MKL GEMMs round a row differently with the row count."""
    cfg = ModelConfig(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position=256, tie_word_embeddings=True)
    model = LlamaModel(cfg, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # random init is near-uniform: scale up, as tests/helpers.py
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    return model.eval()


def random_pool(model, seed):
    """A pool whose every slot holds random K/V (as if earlier steps had written them)."""
    kv = model.new_kv_pool(NUM_PAGES + 1, PAGE)
    gen = torch.Generator().manual_seed(seed)
    for cache in kv.k + kv.v:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return kv


def random_step(b, q_len, rng):
    """b sequences on distinct shuffled pages (never the scratch page): ids, positions, seqs."""
    free = list(range(NUM_PAGES))
    rng.shuffle(free)
    ids, pos, seqs = [], [], []
    for _ in range(b):
        cached = rng.randint(0, 9)
        kv_len = cached + q_len
        table = [free.pop() for _ in range(-(-kv_len // PAGE) + rng.choice([0, 1]))]
        ids += [rng.randrange(1, 97) for _ in range(q_len)]
        pos += range(cached, kv_len)
        seqs.append(SeqAttention(q_len, kv_len, table))
    return torch.tensor(ids), torch.tensor(pos), seqs


def eager(model, kv, backend, ids, pos, seqs, rows):
    meta = backend.plan(seqs, PAGE, model.cfg.num_heads, model.cfg.num_kv_heads,
                        model.cfg.head_dim, model.dtype)
    return model(ids, pos, backend, kv, meta, rows)


def pool_pages(kv):
    """[layers * 2, pages, ...] every cache of the pool, stacked (for page-wise comparisons)."""
    return torch.stack(kv.k + kv.v)


# -- buckets ---------------------------------------------------------------------------------

def test_bucket_for():
    assert [bucket_for(b, BUCKETS) for b in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert bucket_for(1) == 1 and bucket_for(DEFAULT_BUCKETS[-1]) == DEFAULT_BUCKETS[-1]
    assert bucket_for(17) == 24 and bucket_for(DEFAULT_BUCKETS[-1] + 1) is None
    assert list(DEFAULT_BUCKETS) == sorted(set(DEFAULT_BUCKETS))
    with pytest.raises(ValueError):
        bucket_for(0, BUCKETS)


def test_dummy_seq_stays_on_the_scratch_page():
    assert dummy_seq(1, 16, 7) == SeqAttention(1, 1, [7])
    assert dummy_seq(5, 4, 7) == SeqAttention(5, 5, [7, 7])  # q_len > page size wraps


# -- padded runs equal unpadded eager runs ----------------------------------------------------

def _same(dtype):
    """bf16: bit for bit. float32: within rounding (MKL rounds a row per row count)."""
    if dtype == torch.bfloat16:
        return torch.equal
    return lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("q_len", [1, 5])
def test_padded_steps_equal_eager_steps(q_len, dtype):
    model, backend, rng = tiny_model(dtype), ReferenceBackend(), random.Random(q_len)
    same = _same(dtype)
    kv_eager, kv_graph = random_pool(model, 1), random_pool(model, 1)
    runner = GraphRunner(model, kv_graph, backend, q_len, scratch_page=SCRATCH, buckets=BUCKETS)
    for b in STEPS:
        ids, pos, seqs = random_step(b, q_len, rng)
        rows = torch.arange(b * q_len)
        for cache in kv_graph.k + kv_graph.v:  # a sentinel, so any write to it shows
            cache[SCRATCH] = 1e4
        want_hidden, want_logits = eager(model, kv_eager, backend, ids, pos, seqs, rows)
        hidden, logits = runner.forward(ids, pos, seqs, rows)
        assert same(hidden, want_hidden), f"batch {b}: hidden states differ"
        assert same(logits, want_logits), f"batch {b}: logits differ"
        # Every page but the scratch page holds the same KV after both runs: the real rows
        # wrote the same values, and the padding rows wrote nowhere else.
        eager_pages, graph_pages = pool_pages(kv_eager), pool_pages(kv_graph)
        assert same(graph_pages[:, :NUM_PAGES], eager_pages[:, :NUM_PAGES]), f"batch {b}: KV differs"
        padded = bucket_for(b, BUCKETS) not in (b, None)
        assert padded == bool((graph_pages[:, SCRATCH] != 1e4).any()), \
            f"batch {b}: the scratch page is written exactly when the batch is padded"
    assert runner.captured == []  # nothing is captured on the CPU
    assert sorted(runner._buckets) == [1, 2, 4, 8]


def test_logits_rows_select_rows_and_none_skips_logits():
    model, backend, rng = tiny_model(seed=3), ReferenceBackend(), random.Random(0)
    q_len = 5
    kv_eager, kv_graph = random_pool(model, 2), random_pool(model, 2)
    runner = GraphRunner(model, kv_graph, backend, q_len, scratch_page=SCRATCH, buckets=BUCKETS)
    ids, pos, seqs = random_step(3, q_len, rng)
    rows = torch.tensor([14, 4, 9, 0])  # any rows, any order: the last ones of each sequence, ...
    want_hidden, want_logits = eager(model, kv_eager, backend, ids, pos, seqs, rows)
    hidden, logits = runner.forward(ids, pos, seqs, rows)
    assert torch.equal(logits, want_logits) and torch.equal(hidden, want_hidden)
    hidden, logits = runner.forward(ids, pos, seqs)
    assert logits is None and torch.equal(hidden, want_hidden)


def test_custom_head_runs_on_the_selected_rows():
    model, backend, rng = tiny_model(), ReferenceBackend(), random.Random(1)
    kv = random_pool(model, 3)
    half = model.lm_head[:40]  # like the draft's vocab-subset head
    runner = GraphRunner(model, kv, backend, 1, scratch_page=SCRATCH, buckets=BUCKETS,
                         head=lambda h: (h @ half.T).float())
    ids, pos, seqs = random_step(3, 1, rng)
    hidden, logits = runner.forward(ids, pos, seqs, torch.tensor([2, 0]))
    assert logits.shape == (2, 40)
    assert torch.equal(logits, (hidden[[2, 0]] @ half.T).float())


def test_runner_refuses_what_a_graph_cannot_run():
    model = tiny_model()
    kv = random_pool(model, 0)
    with pytest.raises(ValueError, match="scratch page"):
        GraphRunner(model, kv, ReferenceBackend(), 1, scratch_page=NUM_PAGES + 1)
    with pytest.raises(ValueError, match="buckets"):
        GraphRunner(model, kv, ReferenceBackend(), 1, scratch_page=SCRATCH, buckets=(4, 2))
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(model, kv, ReferenceBackend(), 1, scratch_page=SCRATCH, use_graphs=True)
    runner = GraphRunner(model, kv, ReferenceBackend(), 5, scratch_page=SCRATCH, buckets=BUCKETS)
    ids, pos, seqs = random_step(2, 5, random.Random(0))
    with pytest.raises(ValueError, match="q_len"):
        runner.forward(ids[:9], pos[:9], seqs[:1] + [SeqAttention(4, 9, seqs[1].page_table)])
    tree = [SeqAttention(5, s.kv_len, s.page_table, torch.ones(5, 5, dtype=torch.bool)) for s in seqs]
    with pytest.raises(ValueError, match="causal"):
        runner.forward(ids, pos, tree)
    with pytest.raises(ValueError, match="ids and positions"):
        runner.forward(ids[:-1], pos[:-1], seqs)


# -- FlashInfer graph attention on stand-ins for its CUDA-graph wrappers ----------------------

class _FakeWrapper:
    """Stand-in for FlashInfer 0.7.4's paged wrappers, eager or use_cuda_graph=True. In graph
    mode plan() only copies into the constructor's buffers (checking the fixed batch size and
    the indices capacity, as the real one does) and run() reads only those buffers, like a
    replayed kernel: a graph that depended on anything else would fail here."""

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False, **buffers):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.graph, self.tensor_cores = use_cuda_graph, use_tensor_cores
        if use_cuda_graph:
            self.buf = {k.removesuffix("_buffer").removesuffix("_buf"): v for k, v in buffers.items()}
            assert all(t.dtype == torch.int32 for t in self.buf.values())
            self.batch = len(self.buf["paged_kv_last_page_len"])
            self.plans = 0

    def _plan(self, qo_indptr, kv_indptr, indices, last, page_size, dtype, causal):
        self.page_size, self.dtype, self.causal = page_size, dtype, causal
        arrays = dict(qo_indptr=qo_indptr, paged_kv_indptr=kv_indptr, paged_kv_last_page_len=last)
        if not self.graph:
            self.buf = {k: v.clone() for k, v in arrays.items()} | {"paged_kv_indices": indices.clone()}
            return
        assert len(last) == self.batch, "the batch size is fixed in cudagraph mode"
        assert len(indices) <= len(self.buf["paged_kv_indices"]), "indices exceed the buffer"
        for name, value in arrays.items():
            if name in self.buf:  # the decode wrapper has no query indptr buffer
                self.buf[name].copy_(value)
        self.buf["paged_kv_indices"][: len(indices)].copy_(indices)
        self.plans += 1

    def run(self, q, paged_kv_cache, out):
        assert q.dtype == self.dtype and out.shape == q.shape
        k_cache, v_cache = paged_kv_cache
        b_count = len(self.buf["paged_kv_last_page_len"])
        qo = self.buf.get("qo_indptr", torch.arange(b_count + 1, dtype=torch.int32)).tolist()
        kv, idx, last = (self.buf[n].tolist() for n in ("paged_kv_indptr", "paged_kv_indices",
                                                         "paged_kv_last_page_len"))
        assert qo[-1] == q.shape[0]
        for b in range(b_count):
            pages = idx[kv[b]: kv[b + 1]]
            kv_len = (len(pages) - 1) * self.page_size + last[b]
            rows = slice(qo[b], qo[b + 1])
            mask = step_mask(rows.stop - rows.start, kv_len, None)
            k = k_cache[pages].flatten(0, 1)[:kv_len]
            v = v_cache[pages].flatten(0, 1)[:kv_len]
            out[rows] = dense_attention(q[rows], k, v, mask).to(out.dtype)
        return out


class _FakeDecode(_FakeWrapper):
    """q_len_per_req > 1 (0.7.4): the tensor-core path, causal within each request's block,
    qo_indptr = arange * q_len in the wrapper's own buffer (allocated by the real __init__)."""

    def plan(self, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             q_data_type, kv_data_type, q_len_per_req=1):
        assert q_len_per_req == 1 or self.tensor_cores, "q_len_per_req > 1 needs the tensor-core path"
        if self.graph and q_len_per_req > 1:
            self.buf.setdefault("qo_indptr", torch.zeros(self.batch + 1, dtype=torch.int32))
            self.uniform_q_len = q_len_per_req
        self._plan(torch.arange(len(last) + 1, dtype=torch.int32) * q_len_per_req, indptr, indices, last,
                   page_size, q_data_type, q_len_per_req > 1)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, kv_indptr, indices, last, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, causal, q_data_type, kv_data_type, packed_custom_mask=None):
        assert packed_custom_mask is None and causal
        self._plan(qo_indptr, kv_indptr, indices, last, page_size, q_data_type, causal)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """overlap.attention.flashinfer loaded under another name against the stand-ins (the
    real module and sys.modules stay untouched), with unpinned host tensors."""
    return flashinfer_on_fakes(monkeypatch, _FakeDecode, _FakePrefill, "_flashinfer_graphs_on_fakes")


@pytest.mark.parametrize("q_len", [1, 5])
def test_flashinfer_graph_buffers_serve_every_step(fake_flashinfer, q_len):
    """The runner plans each bucket into its FlashInfer graph buffers (not the eager wrapper
    sets) and the result matches the eager reference: bf16, so logits within rounding."""
    model, rng = tiny_model(seed=5), random.Random(10 + q_len)
    kv_eager, kv_graph = random_pool(model, 4), random_pool(model, 4)
    backend = fake_flashinfer.FlashInferBackend("cpu")
    runner = GraphRunner(model, kv_graph, backend, q_len, scratch_page=SCRATCH, buckets=BUCKETS)
    assert not runner.use_graphs  # no capture on the CPU, but the graph buffers are used
    for b in STEPS:
        ids, pos, seqs = random_step(b, q_len, rng)
        rows = torch.arange(b * q_len)
        _, want = eager(model, kv_eager, ReferenceBackend(), ids, pos, seqs, rows)
        _, logits = runner.forward(ids, pos, seqs, rows)
        err = (logits - want).abs().max().item()
        assert err < 0.05, f"batch {b}: max abs logit error {err:.3f}"
        assert torch.equal(logits.argmax(-1), want.argmax(-1))
    attention = {size: bucket.attention for size, bucket in runner._buckets.items()}
    assert all(isinstance(a, fake_flashinfer.FlashInferGraphAttention) for a in attention.values())
    wrappers = {size: a._wrapper for size, a in attention.items()}
    # Graph buckets run the decode wrapper for every q_len: q_len > 1 on its tensor-core path
    # planned with the uniform q_len (not a prefill wrapper tiled for the ragged worst case).
    assert all(w.graph and isinstance(w, _FakeDecode) for w in wrappers.values())
    if q_len > 1:
        assert all(w.tensor_cores and w.uniform_q_len == q_len for w in wrappers.values())
    # Planned once per step of their bucket (4,3 | 8,5 | 2 | 1); 11 ran on the eager wrappers.
    assert {s: w.plans for s, w in wrappers.items()} == {4: 2, 8: 2, 2: 1, 1: 1}
    assert attention[8].slots.shape == (8 * q_len,)


def test_flashinfer_graph_attention_refuses_other_shapes(fake_flashinfer):
    attention = fake_flashinfer.FlashInferBackend("cpu").graph_attention(2, 5, max_pages=4)
    dims = (4, 2, 16, torch.bfloat16)
    ok = [SeqAttention(5, 5, [0, 1]), SeqAttention(5, 7, [2, 3])]
    meta = attention.plan(ok, PAGE, *dims)
    assert meta.slots is attention.slots  # the static buffer the graph's kv.write reads
    assert attention.slots.tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    with pytest.raises(ValueError, match="2 sequences"):
        attention.plan(ok[:1], PAGE, *dims)
    with pytest.raises(ValueError, match="q_len 5"):
        attention.plan([ok[0], SeqAttention(1, 7, [2, 3])], PAGE, *dims)
    with pytest.raises(ValueError, match="exceed"):
        attention.plan([ok[0], SeqAttention(5, 13, [2, 3, 4, 5])], PAGE, *dims)


# -- GPU: captured graphs replay what the eager forward computes ------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("q_len", [1, 5])
def test_cuda_graphs_match_eager_flashinfer(q_len):
    pytest.importorskip("flashinfer")
    from overlap.attention.flashinfer import FlashInferBackend

    model = tiny_model(seed=7, head_dim=64, device="cuda")  # a head_dim FlashInfer compiles
    rng = random.Random(q_len)
    kv_eager = model.new_kv_pool(NUM_PAGES + 1, PAGE)
    kv_graph = model.new_kv_pool(NUM_PAGES + 1, PAGE)
    for a, b in zip(kv_eager.k + kv_eager.v, kv_graph.k + kv_graph.v):
        a.normal_()
        b.copy_(a)
    backend = FlashInferBackend("cuda")
    runner = GraphRunner(model, kv_graph, backend, q_len, scratch_page=SCRATCH, buckets=BUCKETS)
    for b in STEPS:
        ids, pos, seqs = random_step(b, q_len, rng)
        ids, pos, rows = ids.cuda(), pos.cuda(), torch.arange(b * q_len, device="cuda")
        _, want = eager(model, kv_eager, backend, ids, pos, seqs, rows)
        _, logits = runner.forward(ids, pos, seqs, rows)
        torch.cuda.synchronize()
        err = (logits - want).abs().max().item()
        # bf16 rounding may differ (GEMMs over padded row counts, graph-mode KV splits);
        # a wrong page moves logits by whole units (tools/gpu_check.py, GRAPH_MAX_ABS).
        assert err < 0.25, f"batch {b}: max abs logit error {err:.3f}"
    assert runner.captured == [1, 2, 4, 8]
