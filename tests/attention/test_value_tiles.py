"""The AMX variant's value tiles (attention.cpp, tile_values) and the pair copy of the value
cache they read (KVPool.value_pairs): the copy follows every write, the tiles give the
reference loops' bits whether they read the copy or pair the keys themselves. (Rows stay
batch-invariant over the value tiles too: test_cpu_backends.py's batch test, "long" layout.)"""

import math

import pytest
import torch

from overlap.attention.base import SeqAttention, tree_mask_from_parents
from overlap.attention.cpu import CpuBackend
from overlap.kernels import paged_attention, value_pairs_wanted
from overlap.kv import KVPool

H, HKV, D, PAGE = 9, 3, 64, 16
amx_only = pytest.mark.skipif(not value_pairs_wanted(torch.bfloat16, D, PAGE, "cpu"),
                              reason="value tiles run on AMX CPUs (kernel variant 3) only")


def expected_pairs(pool: KVPool, layer: int) -> torch.Tensor:
    """V [pages, page, Hkv, D] in key pairs: [pages, Hkv, page / 2, D, 2]."""
    v = pool.v[layer]
    return v.view(v.shape[0], v.shape[1] // 2, 2, *v.shape[2:]).permute(0, 3, 1, 4, 2)


def test_value_pairs_follow_writes_compaction_and_sync():
    """Kept on any CPU when asked for (the layout is plain copying): write() fills the written
    slots' pairs in its layer, copy_slots() moves them in every layer, sync_value_pairs()
    re-derives them after V is written directly; pools that need none keep none."""
    torch.manual_seed(0)
    pool = KVPool(2, 6, PAGE, HKV, D, torch.bfloat16, value_pairs=True)
    slots = torch.tensor([0, 1, 2, 17, 18, 40, 95])
    for layer in range(2):
        pool.write(layer, slots, torch.randn(7, HKV, D).bfloat16(), torch.randn(7, HKV, D).bfloat16())
        assert torch.equal(pool.value_pairs(layer), expected_pairs(pool, layer))
    pool.copy_slots(torch.tensor([40, 95, 17]), torch.tensor([41, 42, 43]))
    for layer in range(2):
        assert torch.equal(pool.value_pairs(layer), expected_pairs(pool, layer))
    pool.v[1].normal_()
    assert not torch.equal(pool.value_pairs(1), expected_pairs(pool, 1))
    pool.sync_value_pairs()
    assert torch.equal(pool.value_pairs(1), expected_pairs(pool, 1))
    assert pool.nbytes() == 3 * 2 * 6 * PAGE * HKV * D * 2
    assert KVPool(1, 2, PAGE, HKV, D, torch.bfloat16, value_pairs=False).value_pairs(0) is None
    with pytest.raises(ValueError, match="even size"):
        KVPool(1, 2, 5, HKV, D, torch.bfloat16, value_pairs=True)


def _pool(pages: int, seed: int) -> KVPool:
    torch.manual_seed(seed)
    pool = KVPool(1, pages, PAGE, HKV, D, torch.bfloat16)
    pool.k[0].normal_()
    pool.v[0].normal_()
    pool.sync_value_pairs()
    return pool


def _call(q, pool, meta, **kw):
    k, v = pool.flat(0)
    return paged_attention(q, k, v, meta.q_start, meta.q_len, meta.kv_len, meta.page_table, meta.page_size,
                           meta.tree, 1.0 / math.sqrt(D), **kw)


@amx_only
def test_value_tiles_equal_the_reference_loops():
    """Contexts around the chunk edges (15-17, 31-33 keys: no tile part, one chunk, two) and
    long ones, decode rows, verify chains, a tree with a lookup branch and prefill chunks: the
    vector path from the pool's pair copy, the vector path pairing the keys per call and the
    reference loops (1 x 1 tiles) give the same bits."""
    pool, backend = _pool(80, 0), CpuBackend()
    free = torch.randperm(80).tolist()
    branchy = tree_mask_from_parents([-1, 0, 0, 1, 2, 0, 5, 6, 7, 8, 9, 10, 11])  # a tree + an 8-token branch
    cases = [(c, 1, None) for c in (0, 14, 15, 16, 17, 30, 31, 32, 33, 64, 301)]
    cases += [(40, 4, None), (200, 13, branchy), (90, 37, None), (0, 70, None)]
    seqs = [SeqAttention(n, c + n, [free.pop() for _ in range(-(-(c + n) // PAGE))], t) for c, n, t in cases]
    for group in ([s] for s in seqs):
        meta = backend.plan(group, PAGE)
        q = torch.randn(sum(s.q_len for s in group), H, D).bfloat16() * 3
        from_copy = _call(q, pool, meta, v_pairs=pool.value_pairs(0))
        assert torch.isfinite(from_copy.float()).all()
        assert torch.equal(from_copy, _call(q, pool, meta))
        assert torch.equal(from_copy, _call(q, pool, meta, reference=True))


@amx_only
def test_value_tiles_refuse_a_row_far_off_its_leading_path():
    """A tree row's tiled keys must sit at their own positions: one that sees more than 16 new
    tokens beyond its leading run of columns is refused (a 17-token branch off the root's
    first child), not answered with other bits than a decode step would give."""
    pool, backend = _pool(40, 2), CpuBackend()
    deep = tree_mask_from_parents([-1, 0, 0] + list(range(2, 18)))  # node 2's chain runs 17 deep
    seq = SeqAttention(deep.shape[0], 100 + deep.shape[0], list(range(0, 8)), deep)
    with pytest.raises(RuntimeError, match="off its leading path"):
        backend.run(0, torch.randn(seq.q_len, H, D).bfloat16(), pool, backend.plan([seq], PAGE))
    ok = tree_mask_from_parents([-1, 0, 0] + list(range(2, 17)))  # 16 deep: served
    seq = SeqAttention(ok.shape[0], 100 + ok.shape[0], list(range(0, 8)), ok)
    assert torch.isfinite(backend.run(0, torch.randn(seq.q_len, H, D).bfloat16(), pool,
                                      backend.plan([seq], PAGE)).float()).all()
