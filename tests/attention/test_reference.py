"""The paged reference attention equals dense causal attention on random ragged batches."""

import random

import pytest
import torch
import torch.nn.functional as F

from overlap.attention import ReferenceBackend, SeqAttention
from overlap.attention.base import tree_mask_from_parents
from overlap.kv import KVPool, slot_mapping

H, HKV, D = 6, 2, 16


def dense_causal(q, k, v, prefix):
    """q [Q, H, D], k/v [L, Hkv, D]; query i sits at position prefix + i."""
    g = H // HKV
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    mask = torch.arange(k.shape[0])[None, :] <= (prefix + torch.arange(q.shape[0]))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.transpose(0, 1).double(),
                                         v.transpose(0, 1).double(), attn_mask=mask)
    return out.transpose(0, 1).float()


def run_batch(page_size, seqs, seed):
    """seqs: list of (cached, new). Fills random caches, runs one step, checks each sequence."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    total_pages = sum(-(-(c + n) // page_size) for c, n in seqs) + 3
    pool = KVPool(1, total_pages, page_size, HKV, D, torch.float32)
    free = list(range(total_pages))
    rng.shuffle(free)  # pages out of order, like a fragmented pool
    attn, qs, full_k, full_v = [], [], [], []
    for cached, new in seqs:
        table = [free.pop() for _ in range(-(-(cached + new) // page_size))]
        k, v = torch.randn(cached + new, HKV, D), torch.randn(cached + new, HKV, D)
        # The cached prefix is already in the pool; the new tokens are written by the step.
        pool.write(0, torch.tensor(slot_mapping(table, 0, cached + new, page_size)), k, v)
        attn.append(SeqAttention(new, cached + new, table))
        qs.append(torch.randn(new, H, D))
        full_k.append(k)
        full_v.append(v)
    backend = ReferenceBackend()
    meta = backend.plan(attn, page_size)
    out = backend.run(0, torch.cat(qs), pool, meta)
    row = 0
    for (cached, new), q, k, v in zip(seqs, qs, full_k, full_v):
        torch.testing.assert_close(out[row: row + new], dense_causal(q, k, v, cached), rtol=1e-5, atol=1e-5)
        row += new


@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("seed", range(4))
def test_ragged_batches_match_dense(page_size, seed):
    rng = random.Random(seed)
    seqs = []
    for _ in range(rng.randint(1, 7)):
        kind = rng.choice(["prefill", "prefix_prefill", "decode", "verify"])
        cached = 0 if kind == "prefill" else rng.randint(1, 40)
        new = {"prefill": rng.randint(1, 50), "prefix_prefill": rng.randint(17, 40),
               "decode": 1, "verify": rng.randint(2, 6)}[kind]
        seqs.append((cached, new))
    run_batch(page_size, seqs, seed)


def test_tree_mask_equals_each_path_alone():
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
    backend = ReferenceBackend()
    out = backend.run(0, q, pool, backend.plan([SeqAttention(n, prefix + n, table, tree)], page_size))
    for path in ([0, 1, 3], [0, 2]):
        idx = list(range(prefix)) + [prefix + i for i in path]
        ref = dense_causal(q[path], k[idx], v[idx], prefix)
        torch.testing.assert_close(out[path], ref, rtol=1e-5, atol=1e-5)
