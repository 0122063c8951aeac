"""Exactness does not depend on luck: a token's logits are bit-identical whether it runs in a
prefill, a verify pass over k+1 tokens, a single decode step, or a batch with others."""

import pytest
import torch

from helpers import hf_model, our_model, tiny_hf_config
from overlap.attention import ReferenceBackend, SeqAttention
from overlap.attention.cpu import CpuBackend
from overlap.kernels import bf16_arithmetic, linear_bf16, linear_int8, machine_variant
from overlap.models.llama import linear

PAGE = 4

# SmolLM2-135M's matmul shapes [out, in] (qkv, o, gate_up, down, lm_head), and odd ones whose
# k is not a multiple of any vector width and whose n is not a multiple of the column tile.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (37, 77), (5, 40)]


# The avx512bf16 build runs either of two arithmetics (linear_bf16.cpp): each is tested here,
# whichever this machine's loader chose.
ARITHMETICS = ["dot", "fma"] if machine_variant() == 2 else [None]


@pytest.fixture(params=ARITHMETICS, ids=lambda a: a or "only")
def arithmetic(request):
    if request.param is None:
        yield None
        return
    with bf16_arithmetic(request.param):
        yield request.param


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_rows_do_not_depend_on_batch(shape, arithmetic):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([linear(x[i: i + 1], w, bias) for i in range(len(x))])
    for rows in range(1, len(x) + 1):
        assert torch.equal(linear(x[:rows], w, bias), alone[:rows]), f"{shape}: rows differ with M={rows}"
    # A row's result does not depend on what the other rows hold either.
    shuffled = torch.cat([torch.randn(7, k, generator=gen).to(torch.bfloat16), x[:5]])
    assert torch.equal(linear(shuffled, w, bias)[7:], alone[:5])


@pytest.mark.parametrize("kernel", [linear_bf16, linear_int8], ids=["bf16", "int8"])
def test_linear_of_no_rows_is_empty(kernel):
    """A pass with no rows to compute (e.g. no logits wanted this step) gets an empty result,
    not a crash (a division by the tile count once killed the process with SIGFPE)."""
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16)
    for out_float in (False, True):
        y = kernel(torch.empty(0, 64, dtype=torch.bfloat16), w, out_float=out_float)
        assert y.shape == (0, 48) and y.dtype == (torch.float32 if out_float else torch.bfloat16)


def test_fma_arithmetic_is_one_fma_per_k_in_order(arithmetic):
    """Every build but AMX and the avx512bf16 build's dot products computes each output as one
    f32 FMA per k, k in order (linear_bf16.cpp): the bits of a plain f32 loop over k, where a
    bf16 x bf16 product is exact in f32 (8-bit significands) and each add rounds once, as the
    FMA does. A different order or a rounded product changes low bits."""
    if machine_variant() == 3 or arithmetic == "dot":
        pytest.skip("AMX tiles and vdpbf16ps sum in the hardware's own order")
    gen = torch.Generator().manual_seed(3)
    for n, k in [(960, 576), (37, 77), (5, 40)]:
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
        got = linear_bf16(x, w, out_float=True)
        want = torch.zeros(9, n)
        xf, wf = x.float(), w.float()
        for j in range(k):
            want = want + xf[:, j: j + 1] * wf[:, j]
        assert torch.equal(got, want), (n, k, (got - want).abs().max())


def test_linear_sums_match_float32():
    """The kernel computes the same sum as f32 math (only the order differs): a wrong index
    or a dropped tail shows up as a large error."""
    gen = torch.Generator().manual_seed(1)
    for n, k in SHAPES[:1] + SHAPES[-2:]:
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
        want = x.float() @ w.float().T
        got = linear_bf16(x, w, out_float=True)
        assert torch.allclose(got, want, rtol=0, atol=1e-4 * k ** 0.5), (n, k, (got - want).abs().max())


class Runner:
    """Drives the model over sequences with explicit page tables."""

    def __init__(self, model, backend):
        self.model = model
        self.kv = model.new_kv_pool(64, PAGE)
        self.backend = backend()

    def run(self, chunks):
        """chunks: list of (page_table, start, token_ids) → logits of every new token, per chunk."""
        ids, pos, attn = [], [], []
        for table, start, toks in chunks:
            ids += toks
            pos += range(start, start + len(toks))
            attn.append(SeqAttention(len(toks), start + len(toks), table))
        meta = self.backend.plan(attn, PAGE)
        _, logits = self.model(torch.tensor(ids), torch.tensor(pos), self.backend, self.kv, meta,
                               torch.arange(len(ids)))
        out, row = [], 0
        for _, _, toks in chunks:
            out.append(logits[row: row + len(toks)])
            row += len(toks)
        return out


def verify_vs_decode(model, backend):
    prompt = list(range(10, 47))
    follow = [7, 99, 23, 5, 300]
    # A: prefill, then one decode step per token.
    a = Runner(model, backend)
    a.run([([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 0, prompt)])
    steps = [a.run([([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], len(prompt) + i, [t])])[0]
             for i, t in enumerate(follow)]
    # B: prefill in two chunks, then one verify pass over all follow tokens, in a batch with
    #    two other sequences (one prefilling, one decoding) on other pages.
    b = Runner(model, backend)
    table = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    b.run([(table, 0, prompt[:20]), ([40, 41], 0, [3, 4, 5])])
    b.run([(table, 20, prompt[20:]), ([40, 41], 3, [9])])
    verify = b.run([([50, 51, 52, 53, 54, 55, 56, 57, 58, 59], 0, list(range(100, 140))),
                    (table, len(prompt), follow), ([40, 41], 4, [11])])[1]
    for i, step in enumerate(steps):
        assert torch.equal(step[0], verify[i]), f"token {i}: verify and decode logits differ"


@pytest.mark.parametrize("backend", [CpuBackend, ReferenceBackend], ids=["cpu", "reference"])
def test_verify_equals_decode_steps_and_batching(backend):
    cfg = tiny_hf_config(hidden=128, heads=4, kv_heads=2, layers=3)
    verify_vs_decode(our_model(hf_model(cfg), cfg, torch.bfloat16), backend)
