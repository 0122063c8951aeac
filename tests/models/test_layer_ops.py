"""The fused bf16 layer ops (overlap/kernels/layer_ops.cpp) compute what the eager ops do."""

import pytest
import torch
import torch.nn.functional as F

from overlap import kernels
from overlap.models.rope import rotate


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _ulps(a, b):
    """Largest distance in bf16 steps between two bf16 tensors of the same sign pattern."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()


def test_rotary_in_place_equals_rotate_half_bit_for_bit():
    t, heads, dim = 7, 5, 64
    qkv = _bf16(t, heads * dim + 3 * dim, seed=0)
    cos, sin = _bf16(t, dim, seed=1), _bf16(t, dim, seed=2)
    want = rotate(qkv[:, : 4 * dim].view(t, 4, dim), cos[:, None], sin[:, None])
    got = qkv.clone()
    kernels.rotary_(got, cos, sin, 4, dim)
    assert torch.equal(got[:, : 4 * dim].view(t, 4, dim), want)
    assert torch.equal(got[:, 4 * dim:], qkv[:, 4 * dim:])  # the other heads (v) untouched


def test_rms_norm_and_silu_mul_match_eager_within_one_ulp():
    x, w = _bf16(9, 576, seed=3), _bf16(576, seed=4)
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = kernels.rms_norm(x, w, 1e-5)
    assert _ulps(got, want) <= 1 and (got == want).float().mean() > 0.99
    gate_up = _bf16(9, 2 * 1536, seed=5)
    gate, up = gate_up.chunk(2, -1)
    got, want = kernels.silu_mul(gate_up), F.silu(gate) * up
    assert _ulps(got, want) <= 1 and (got == want).float().mean() > 0.99


def test_fused_ops_rows_do_not_depend_on_the_batch():
    x, w = _bf16(33, 576, seed=6), _bf16(576, seed=7)
    gate_up = _bf16(33, 256, seed=8)
    for i in (0, 16, 32):
        assert torch.equal(kernels.rms_norm(x[i: i + 1], w, 1e-5), kernels.rms_norm(x, w, 1e-5)[i: i + 1])
        assert torch.equal(kernels.silu_mul(gate_up[i: i + 1]), kernels.silu_mul(gate_up)[i: i + 1])


def test_silu_mul_vector_body_and_scalar_tail_give_the_same_bits():
    """SwiGLU runs 16 lanes at a time where the CPU has AVX-512 and the rest of a row one by
    one: a value must come out the same in either (else a token's result would depend on the
    intermediate width's remainder)."""
    inter = 16 + 8  # one vector body, an 8-element tail
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 90.0, -90.0, 1e-30])
    gate = torch.cat([special, _bf16(1, 8, seed=9)[0].float() * 4, special])
    up = torch.cat([_bf16(1, 8, seed=10)[0].float()] * 3)
    got = kernels.silu_mul(torch.cat([gate, up]).to(torch.bfloat16)[None])[0]
    assert torch.equal(got[:8].view(torch.int16), got[16:].view(torch.int16))


def test_argmax_rows_equals_torch_argmax_on_ties_infinities_and_nans():
    """Greedy decoding and verification pick through this kernel: any other index than
    torch.argmax's (the first maximum; a NaN counts as the largest) would change outputs."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 17, 33, 1000, 49153):
        for _ in range(5):
            rows = [torch.randint(-2, 2, (n,), generator=gen).float(),  # ties everywhere
                    torch.randn(n, generator=gen),
                    torch.full((n,), float("-inf")),  # a trimmed vocabulary's row: all -inf but one
                    torch.randn(n, generator=gen),
                    torch.randn(n, generator=gen)]
            rows[2][torch.randint(n, (1,), generator=gen)] = 0.5
            rows[3][torch.randint(n, (2,), generator=gen)] = float("nan")
            rows[4][torch.randint(n, (3,), generator=gen)] = float("inf")
            x = torch.stack(rows)
            assert torch.equal(kernels.argmax_rows(x), x.argmax(-1)), n
    assert kernels.argmax_rows(torch.zeros(0, 7)).shape == (0,)


def test_spread_columns_equals_full_then_index_put():
    """A trimmed vocabulary's scores into full rows (-inf elsewhere), as torch would build them."""
    from overlap.kernels import spread_columns
    from overlap.models.llama import spread_vocabulary

    gen = torch.Generator().manual_seed(5)
    for vocab, n, rows in [(49152, 8192, 1), (49152, 8192, 3), (20, 5, 2), (7, 7, 1), (9, 1, 1)]:
        ids = torch.randperm(vocab, generator=gen)[:n].sort().values
        sub = torch.randn(rows, n, generator=gen)
        want = torch.full((rows, vocab), float("-inf"))
        want[:, ids] = sub
        assert torch.equal(spread_columns(sub, ids, vocab), want)
        assert torch.equal(spread_vocabulary(sub, ids, vocab), want)
    with pytest.raises(RuntimeError, match="ascend"):
        spread_columns(torch.zeros(1, 2), torch.tensor([3, 1]), 5)
    with pytest.raises(RuntimeError, match="ascend"):
        spread_columns(torch.zeros(1, 1), torch.tensor([5]), 5)
