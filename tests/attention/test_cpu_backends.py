"""The CPU attention backends (the compiled `cpu` kernel and the pure-torch reference) equal
dense causal attention on random ragged batches and trees; the cpu kernel is batch-invariant."""

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from overlap.attention import ReferenceBackend, SeqAttention
from overlap.attention.base import tree_mask_from_parents
from overlap.attention.cpu import CpuBackend
from overlap.kv import KVPool, slot_mapping

H, HKV, D = 6, 2, 16


def dense_causal(q, k, v, prefix):
    """q [Q, H, D], k/v [L, Hkv, D]; query i sits at position prefix + i."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    mask = torch.arange(k.shape[0])[None, :] <= (prefix + torch.arange(q.shape[0]))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.transpose(0, 1).double(),
                                         v.transpose(0, 1).double(), attn_mask=mask)
    return out.transpose(0, 1).float()


BACKENDS = {"reference": ReferenceBackend, "cpu": CpuBackend}


def run_batch(backend, page_size, seqs, seed, heads=(H, HKV, D), dtype=torch.float32, tol=1e-5):
    """seqs: list of (cached, new). Fills random caches, runs one step, checks each sequence."""
    h, hkv, d = heads
    rng = random.Random(seed)
    torch.manual_seed(seed)
    total_pages = sum(-(-(c + n) // page_size) for c, n in seqs) + 3
    pool = KVPool(1, total_pages, page_size, hkv, d, dtype)
    free = list(range(total_pages))
    rng.shuffle(free)  # pages out of order, like a fragmented pool
    attn, qs, full_k, full_v = [], [], [], []
    for cached, new in seqs:
        table = [free.pop() for _ in range(-(-(cached + new) // page_size))]
        k, v = torch.randn(cached + new, hkv, d).to(dtype), torch.randn(cached + new, hkv, d).to(dtype)
        # The cached prefix is already in the pool; the new tokens are written by the step.
        pool.write(0, torch.tensor(slot_mapping(table, 0, cached + new, page_size)), k, v)
        attn.append(SeqAttention(new, cached + new, table))
        qs.append(torch.randn(new, h, d).to(dtype))
        full_k.append(k)
        full_v.append(v)
    meta = backend.plan(attn, page_size)
    out = backend.run(0, torch.cat(qs), pool, meta)
    row = 0
    for (cached, new), q, k, v in zip(seqs, qs, full_k, full_v):
        want = dense_causal(q.float(), k.float(), v.float(), cached)
        torch.testing.assert_close(out[row: row + new].float(), want, rtol=tol, atol=tol)
        row += new


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("seed", range(4))
def test_ragged_batches_match_dense(backend, page_size, seed):
    rng = random.Random(seed)
    seqs = []
    for _ in range(rng.randint(1, 7)):
        kind = rng.choice(["prefill", "prefix_prefill", "decode", "verify"])
        cached = 0 if kind == "prefill" else rng.randint(1, 40)
        new = {"prefill": rng.randint(1, 50), "prefix_prefill": rng.randint(17, 40),
               "decode": 1, "verify": rng.randint(2, 6)}[kind]
        seqs.append((cached, new))
    run_batch(BACKENDS[backend](), page_size, seqs, seed)


@pytest.mark.parametrize("seed", range(3))
def test_cpu_kernel_bf16_head_dim_64_matches_dense(seed):
    """bf16 caches with SmolLM2's heads (9 x 64, 3 kv heads): on AMX machines the scores come
    from tiles (attention.cpp's tile_scores), elsewhere from the vector path; either way the
    output is dense attention to within bf16's rounding of it."""
    seqs = [(0, 45), (70, 1), (33, 14), (100, 4), (5, 17)]
    run_batch(CpuBackend(), 16, seqs, seed, heads=(9, 3, 64), dtype=torch.bfloat16, tol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_mask_equals_each_path_alone(backend):
    """A tree of new tokens under a mask equals running each root-to-leaf path causally."""
    torch.manual_seed(0)
    page_size, prefix = 4, 9
    # Tree: 0 is the root; 1, 2 children of 0; 3 child of 1.  Paths: [0,1,3], [0,2].
    tree = tree_mask_from_parents([-1, 0, 0, 1])
    n = tree.shape[0]
    pool = KVPool(1, 8, page_size, HKV, D, torch.float32)
    table = [5, 2, 7, 0]
    k, v = torch.randn(prefix + n, HKV, D), torch.randn(prefix + n, HKV, D)
    pool.write(0, torch.tensor(slot_mapping(table, 0, prefix + n, page_size)), k, v)
    q = torch.randn(n, H, D)
    backend = BACKENDS[backend]()
    out = backend.run(0, q, pool, backend.plan([SeqAttention(n, prefix + n, table, tree)], page_size))
    for path in ([0, 1, 3], [0, 2]):
        idx = list(range(prefix)) + [prefix + i for i in path]
        ref = dense_causal(q[path], k[idx], v[idx], prefix)
        torch.testing.assert_close(out[path], ref, rtol=1e-5, atol=1e-5)


# (page size, [(new rows, context, tree parents or None)], the verify chains' first rows):
# short contexts on 4-token pages; long ones on 16-token pages, where the AMX variant sums
# the older keys' values on tiles (attention.cpp, tile_values) and the rest in f32 loops.
BATCH_LAYOUTS = {
    "short": (4, [(1, 21, None), (4, 13, None), (6, 15, [-1, 0, 0, 1, 1, 2]), (37, 37, None)], [1]),
    "long": (16, [(1, 290, None), (5, 130, None), (6, 220, [-1, 0, 0, 1, 1, 2]), (70, 200, None)], [1, 12]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(H, HKV, D), (9, 3, 64)])
@pytest.mark.parametrize("layout", list(BATCH_LAYOUTS))
def test_cpu_kernel_rows_do_not_depend_on_the_batch(dtype, heads, layout):
    """A decode row, a verify pass, a tree and a prefill chunk of one sequence give the same
    bits alone and batched with other sequences (and under other row splits), and the rows
    of a verify pass (or prefill chunk) equal the same tokens run as single decode steps.
    Head dim 64 in bf16 takes the AMX tile scores (and, on 16-token pages, value tiles)
    where the machine has them."""
    h, hkv, d = heads
    page_size, shapes, first_rows = BATCH_LAYOUTS[layout]
    torch.manual_seed(0)
    seqs, next_page = [], 0
    for q_len, kv_len, parents in shapes:
        pages = -(-kv_len // page_size)
        tree = tree_mask_from_parents(parents) if parents else None
        seqs.append(SeqAttention(q_len, kv_len, list(range(next_page, next_page + pages)), tree))
        next_page += pages
    pool = KVPool(1, next_page, page_size, hkv, d, dtype)
    pool.k[0].normal_()
    pool.v[0].normal_()
    pool.sync_value_pairs()
    qs = [torch.randn(s.q_len, h, d).to(dtype) for s in seqs]
    backend = CpuBackend()
    together = backend.run(0, torch.cat(qs), pool, backend.plan(seqs, page_size))
    row = 0
    for s, q in zip(seqs, qs):
        alone = backend.run(0, q, pool, backend.plan([s], page_size))
        assert torch.equal(alone, together[row: row + s.q_len])
        row += s.q_len
    # The rows of the chain (and the prefill chunk) equal the same tokens run as decode steps.
    for index, first_row in zip((1, 3), first_rows):
        s = seqs[index]
        for i in range(s.q_len):
            step = SeqAttention(1, s.kv_len - s.q_len + i + 1, s.page_table)
            assert torch.equal(backend.run(0, qs[index][i: i + 1], pool, backend.plan([step], page_size))[0],
                               together[first_row + i])


def _kernel_cases():
    """Fixed random cases for the cpu kernel (bf16/f16/f32, head_dim 16/32/64, causal and tree
    rows, ragged): (q, pool, plan) each."""
    b = CpuBackend()
    for seed, (hkv, d, dtype) in enumerate([(2, 16, torch.bfloat16), (3, 64, torch.bfloat16),
                                            (3, 64, torch.float16), (2, 32, torch.float32)]):
        torch.manual_seed(seed)
        page, heads = 5, 3 * hkv
        tree = tree_mask_from_parents([-1, 0, 0, 1, 2, 2, 3])
        seqs = [(40, 1, None), (0, 37, None), (70, 7, tree), (19, 4, None)]
        pool = KVPool(1, 60, page, hkv, d, dtype)
        pool.k[0].normal_()
        pool.v[0].normal_()
        pool.sync_value_pairs()
        free = torch.randperm(60).tolist()
        attn = [SeqAttention(n, c + n, [free.pop() for _ in range(-(-(c + n) // page))], t) for c, n, t in seqs]
        q = (torch.randn(sum(n for _, n, _ in seqs), heads, d) * 3).to(dtype)
        yield q, pool, b.plan(attn, page)


def _kernel_outputs(path: str) -> None:
    """The cpu backend's outputs on _kernel_cases, saved: the subprocess half of the test below."""
    torch.save([CpuBackend().run(0, q, pool, meta) for q, pool, meta in _kernel_cases()], path)


def test_vector_path_equals_reference_loops():
    """attention.cpp's vector path (AVX2 and AVX-512 variants) computes the reference loops'
    arithmetic in another arrangement: the same bits, on whatever this machine runs. On AMX
    machines the bf16 head_dim-64 case compares scores from 16 x 16 tiles with scores from
    1 x 1 tiles: a score does not depend on its place in a tile."""
    import math

    from overlap.kernels import paged_attention
    for q, pool, m in _kernel_cases():
        k, v = pool.flat(0)
        args = (q, k, v, m.q_start, m.q_len, m.kv_len, m.page_table, m.page_size, m.tree, 1.0 / math.sqrt(q.shape[-1]))
        vector, loops = paged_attention(*args), paged_attention(*args, reference=True)
        assert torch.isfinite(vector.float()).all()
        assert torch.equal(vector, loops)


@pytest.mark.slow
def test_vector_paths_agree_across_variants(tmp_path):
    """The AVX-512 variants' vector path and the AVX2 variant's (16 lanes as two halves, its
    own lane-sum tree) give the same bits, each in a process of its own. (An AMX machine runs
    the wide side capped to AVX512_BF16: variant 3 scores bf16 on tiles, its own arithmetic.)"""
    import os
    import subprocess
    import sys

    from overlap.kernels import cpu_flags, variant_name
    if variant_name() in ("avx2", "generic") or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs a CPU (and ISA cap) that runs the AVX-512 kernels and can run AVX2 ones")
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           "import test_cpu_backends as t; t._kernel_outputs(sys.argv[1])"
    wide = "AVX512_CORE_BF16" if variant_name() == "amx" else os.environ.get("ONEDNN_MAX_CPU_ISA")
    for name, cap in (("avx512", wide), ("avx2", "AVX2")):
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        if cap:  # the caller's cap (or none) for the AVX-512 path, AVX2 for the other
            env["ONEDNN_MAX_CPU_ISA"] = cap
        subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], env=env, check=True, timeout=900)
    for wide, narrow in zip(torch.load(tmp_path / "avx512"), torch.load(tmp_path / "avx2")):
        assert torch.equal(wide, narrow)


def test_cpu_plan_fields_on_random_batches():
    """The plan's tensors, against the page tables read position by position: every new
    token's slot, each sequence's first row, lengths, the zero-padded table, the tree rows."""
    rng, page_size = random.Random(3), 4
    for _ in range(200):
        seqs = []
        for _ in range(rng.randint(1, 5)):
            kv_len = rng.randint(1, 40)
            q_len = rng.randint(1, kv_len)
            table = rng.sample(range(100), -(-kv_len // page_size) + rng.randint(0, 2))
            tree = torch.rand(q_len, q_len) > 0.5 if rng.random() < 0.3 else None
            seqs.append(SeqAttention(q_len, kv_len, table, tree))
        meta = CpuBackend().plan(seqs, page_size)
        width = max(len(s.page_table) for s in seqs)
        row, slots = 0, []
        for i, s in enumerate(seqs):
            assert (meta.q_start[i].item(), meta.q_len[i].item(), meta.kv_len[i].item()) == (row, s.q_len, s.kv_len)
            assert meta.page_table[i].tolist() == s.page_table + [0] * (width - len(s.page_table))
            for pos in range(s.kv_len - s.q_len, s.kv_len):
                page, offset = divmod(pos, page_size)
                slots.append(s.page_table[page] * page_size + offset)
            if meta.tree is not None:
                own = s.tree_mask if s.tree_mask is not None else torch.ones(s.q_len, s.q_len).tril().bool()
                assert torch.equal(meta.tree[row: row + s.q_len, : s.q_len], own)
            row += s.q_len
        assert meta.slots.dtype == torch.long and meta.slots.tolist() == slots
        assert meta.q_start.dtype == meta.q_len.dtype == meta.kv_len.dtype == meta.page_table.dtype == torch.int32
        assert (meta.tree is None) == all(s.tree_mask is None for s in seqs)


def test_kv_copy_slots_moves_every_layer_and_only_the_given_slots():
    """Tree compaction: slot dst[i] takes what src[i] held (read before any write), in every
    layer of K and V; other slots and the layers' separate views stay as they were."""
    pool = KVPool(3, 4, 4, HKV, D, torch.float32)
    for cache in pool.k + pool.v:
        cache.normal_()
    before = [c.clone() for c in pool.k + pool.v]
    src, dst = torch.tensor([5, 9, 6]), torch.tensor([6, 7, 8])  # slot 6 is read and written
    pool.copy_slots(src, dst)
    for cache, old in zip(pool.k + pool.v, before):
        want = old.view(-1, HKV, D).clone()
        want[dst] = old.view(-1, HKV, D)[src]
        assert torch.equal(cache.view(-1, HKV, D), want)
    # a layer's cache is still its own: writing one layer leaves the others alone
    pool.write(1, torch.tensor([0]), torch.ones(1, HKV, D), torch.ones(1, HKV, D))
    assert not torch.equal(pool.k[0].view(-1, HKV, D)[0], torch.ones(HKV, D))
    assert pool.nbytes() == 2 * 3 * 4 * 4 * HKV * D * 4
