"""The drafters' weight-only int8 linear (overlap/kernels/linear_int8.cpp): the sums it
computes, rows that do not depend on the batch, and the same checks on the other ISA
variants (each rounds its own way)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from overlap.kernels import cpu_flags, int8_packed, linear_int8, quantize_int8, variant_name
from overlap.models.llama import int8_linear, logits_linear

# SmolLM2-135M's drafter shapes [out, in] (qkv, o, gate_up, down, fusion, 8k lm_head rows) and
# odd ones: k not a multiple of any vector width or pair, n not a multiple of a column block.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (576, 1152), (8192, 576), (37, 77), (5, 41)]


def dequantized(w):
    q, scale = quantize_int8(w)
    return q.float() * scale[:, None]


def check_sums(n, k, gen):
    """The kernel's sums against f32 math on the dequantized weight. The integer path (AVX512
    VNNI variants) also quantizes each x row to int16: ~1e-4 of the row's largest product."""
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
    want = x.float() @ dequantized(w).T + bias.float()
    got = linear_int8(x, w, bias, out_float=True)
    bound = 3e-4 * (x.float().abs().amax(1, keepdim=True) * dequantized(w).abs().amax(1)).mul(k ** 0.5) + 1e-6
    assert ((got - want).abs() <= bound).all(), (n, k, (got - want).abs().max())
    assert torch.equal(linear_int8(x, w, bias), got.to(torch.bfloat16))  # bf16 out: the f32 sum rounded once


def test_quantization_is_symmetric_per_output_row():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.0, -0.01]], dtype=torch.bfloat16)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0] and scale[1] == 0
    assert q[2].abs().max() == 127 and q[2, 2] == 0  # -0.01 rounds to 0 at scale 3/127
    w = torch.randn(50, 70, dtype=torch.bfloat16)
    err = (dequantized(w) - w.float()).abs()
    assert (err <= quantize_int8(w)[1][:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_rows_do_not_depend_on_batch(shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 5 + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(13, k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([int8_linear(x[i: i + 1], w) for i in range(len(x))])
    for rows in range(1, len(x) + 1):
        assert torch.equal(int8_linear(x[:rows], w), alone[:rows]), f"{shape}: rows differ with M={rows}"
    shuffled = torch.cat([torch.randn(6, k, generator=gen).to(torch.bfloat16) * 9, x[:5]])
    assert torch.equal(int8_linear(shuffled, w)[6:], alone[:5])


def test_int8_sums_match_the_dequantized_weight():
    gen = torch.Generator().manual_seed(3)
    for n, k in SHAPES:
        check_sums(n, k, gen)


def test_int8_logits_are_f32_sums_and_zero_rows_stay_zero():
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(300, 64, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    x[1] = 0
    logits = logits_linear(x, w, int8_linear)
    assert logits.dtype == torch.float32 and torch.equal(logits, linear_int8(x, w, out_float=True))
    assert torch.equal(logits[1], torch.zeros(300))


def test_int32_sums_do_not_overflow_at_the_bound():
    """The largest x and weights over a long row: the integer path's int16 bound on x keeps
    every int32 sum exact (a bound one too loose wraps around)."""
    for k in (576, 4096, 16384):
        w = torch.full((64, k), -1.0, dtype=torch.bfloat16)  # q = -127 everywhere
        x = torch.full((2, k), 3.0, dtype=torch.bfloat16)
        got = linear_int8(x, w, out_float=True)
        assert torch.allclose(got, torch.full((2, 64), -3.0 * k), rtol=1e-4), (k, got[0, 0])
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        __import__("overlap.kernels", fromlist=["_library"])._library().pack_int8(
            torch.tensor([[-128, 0]], dtype=torch.int8))


def test_non_finite_and_tiny_rows():
    """A row with inf or NaN gives NaN (never finite garbage); a row of tiny values is
    zero, never overflowed (below ~1e-26 it counts as zeros); a zero row gives zeros."""
    w = (torch.randn(40, 64, generator=torch.Generator().manual_seed(6)) * 0.05).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    x[0, 3], x[1, 5], x[2] = float("nan"), float("inf"), 0.0
    x[3] = x[3] * 1e-37  # denormal-adjacent values
    got = linear_int8(x, w, out_float=True)
    assert not torch.isfinite(got[0]).any() and not torch.isfinite(got[1]).any()
    assert torch.equal(got[2], torch.zeros(40))
    assert torch.isfinite(got[3]).all() and got[3].abs().max() < 1e-30
    assert torch.isfinite(got[4]).all()


def test_the_int8_copy_follows_the_weight():
    """Quantized once and kept on the weight; remade when the weight changes in place."""
    w = torch.randn(64, 32).to(torch.bfloat16)
    first = int8_packed(w)
    assert int8_packed(w)[0] is first[0]
    w.mul_(2)
    again = int8_packed(w)
    assert again[0] is not first[0] and torch.allclose(again[1], first[1] * 2)
    x = torch.randn(2, 32).to(torch.bfloat16)
    assert torch.allclose(linear_int8(x, w, out_float=True), x.float() @ dequantized(w).T, rtol=1e-3, atol=1e-3)


WORKER = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from overlap.kernels import variant_name
    import test_int8_linear as t
    gen = torch.Generator().manual_seed(11)
    for n, k in t.SHAPES:
        t.check_sums(n, k, gen)
    t.test_int8_rows_do_not_depend_on_batch((37, 77))
    t.test_int8_rows_do_not_depend_on_batch((960, 576))
    t.test_non_finite_and_tiny_rows()
    print(json.dumps({"variant": variant_name()}))
""")


@pytest.mark.parametrize("cap,variant,needs", [
    ("AVX512_CORE", "avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    ("AVX2", "avx2", {"avx2", "fma"}),
])
def test_int8_kernel_on_other_isa_variants(cap, variant, needs):
    """The f32-FMA variants (AVX512F, AVX2) under an ISA cap, in a process of their own (the
    variant is chosen when the kernels load); this process runs the machine's best."""
    if variant_name() == variant or not needs <= cpu_flags():
        pytest.skip(f"this process already runs {variant_name()}, or the CPU lacks {cap}")
    here = os.path.dirname(__file__)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap,
           "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", WORKER, here], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"variant": variant}
