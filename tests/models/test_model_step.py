"""The target's (and a draft model's) pass as one kernel call on the CPU (kernels.model_step)
gives the bits of the op-by-op forward it replaces."""

import pytest
import torch

from helpers import hf_model, our_model, tiny_hf_config
from overlap.attention.base import SeqAttention, tree_mask_from_parents
from overlap.attention.cpu import CpuBackend
from overlap.kv import KVPool
from overlap.models.llama import LlamaModel, matmul_fn

PAGE = 4


def tiny_model(matmul: str, bias: bool) -> LlamaModel:
    cfg = tiny_hf_config(vocab=512, hidden=64, layers=3, heads=4, kv_heads=2, bias=bias, model_type="llama")
    model = our_model(hf_model(cfg, seed=3), cfg, torch.bfloat16)
    model.matmul, model.linear = matmul, matmul_fn(matmul)
    for layer in model.layers:
        layer.linear = model.linear
    with torch.no_grad():  # norm weights off 1, so a skipped or misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


@pytest.mark.parametrize("matmul", ["exact", "int8"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("value_pairs", [False, True])
def test_fused_pass_equals_the_python_forward(matmul, bias, value_pairs):
    """Hidden states, logits and every KV slot written (and V's pair copy), for a causal and a
    tree-masked sequence in one pass, a tree alone, a pass without logits, and a multi-layer
    head's features; a weight changed in place is read on the next pass."""
    model = tiny_model(matmul, bias)
    c = model.cfg
    gen = torch.Generator().manual_seed(7)
    k0 = torch.randn(c.num_layers, 8, PAGE, c.num_kv_heads, c.head_dim, generator=gen).bfloat16()
    v0 = torch.randn(c.num_layers, 8, PAGE, c.num_kv_heads, c.head_dim, generator=gen).bfloat16()
    ids = torch.randint(0, 512, (5,), generator=gen)
    backend = CpuBackend()
    both = [SeqAttention(2, 7, [1, 2]), SeqAttention(3, 11, [3, 4, 5], tree_mask=tree_mask_from_parents([-1, 0, 0]))]
    positions = torch.tensor([5, 6, 8, 9, 9])

    def run(fused: bool, seqs, rows, taps=()):
        model.__dict__.pop("_fused_step", None)
        if not fused:
            model._fused_step = lambda meta, kv: None  # the op-by-op forward
        model.feature_layers = taps
        kv = KVPool(c.num_layers, 8, PAGE, c.num_kv_heads, c.head_dim, torch.bfloat16, value_pairs=value_pairs)
        kv._k_all.copy_(k0)
        kv._v_all.copy_(v0)
        kv.sync_value_pairs()
        n = sum(s.q_len for s in seqs)
        states, logits = model(ids[:n], positions[:n], backend, kv, backend.plan(seqs, PAGE), rows)
        return states, logits, kv._k_all, kv._v_all, kv.slot_arrays()[2]

    cases = [(both, torch.tensor([1, 4, 2]), ()), (both[1:], torch.tensor([0, 2]), ()), (both, None, ()),
             (both, torch.tensor([0, 3]), (0, 2))]
    for seqs, rows, taps in cases:
        got, want = run(True, seqs, rows, taps), run(False, seqs, rows, taps)
        assert model._fused.step is not None  # the fused pass did run
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
        if taps:
            assert got[0].shape[-1] == len(taps) * c.hidden_size
    with torch.no_grad():
        model.layers[1].o_proj.mul_(2)  # in place: the packed copies must follow
    assert torch.equal(run(True, both, torch.tensor([0]))[1], run(False, both, torch.tensor([0]))[1])


def test_no_fused_pass_where_it_does_not_apply():
    """float32 weights, oneDNN's matmuls and a tensor-parallel shard keep the Python forward."""
    cfg = tiny_hf_config(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2)
    kv = KVPool(2, 4, PAGE, 2, 16, torch.bfloat16)
    meta = CpuBackend().plan([SeqAttention(1, 1, [0])], PAGE)
    assert our_model(hf_model(cfg), cfg, torch.float32)._fused_step(meta, kv) is None
    fast = tiny_model("fast", False)
    assert fast._fused_step(meta, kv) is None
    sharded = tiny_model("exact", False)
    sharded.layers[0].reduce = lambda x: x
    assert sharded._fused_step(meta, kv) is None
    assert tiny_model("exact", False)._fused_step(meta, kv) is not None
