"""Exactness does not depend on luck: a token's logits are bit-identical whether it runs in a
prefill, a verify pass over k+1 tokens, a single decode step, or a batch with others."""

import pytest
import torch

from helpers import hf_model, our_model, tiny_hf_config
from overlap.attention import ReferenceBackend, SeqAttention
from overlap.models.llama import ROW_BLOCK, linear

PAGE = 4


@pytest.mark.parametrize("rows", [1, 2, 5, 31, 32, 33, 100])
def test_linear_rows_do_not_depend_on_batch(rows):
    torch.manual_seed(0)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    together = linear(x, w)
    alone = torch.cat([linear(x[i: i + 1], w) for i in range(rows)])
    assert torch.equal(together, alone), f"rows differ with {rows} rows (ROW_BLOCK={ROW_BLOCK})"


class Runner:
    """Drives the model over sequences with explicit page tables."""

    def __init__(self, model):
        self.model = model
        self.kv = model.new_kv_pool(64, PAGE)
        self.backend = ReferenceBackend()

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


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_verify_equals_decode_steps_and_batching(dtype):
    cfg = tiny_hf_config(hidden=128, heads=4, kv_heads=2, layers=3)
    model = our_model(hf_model(cfg), cfg, dtype)
    prompt = list(range(10, 47))
    follow = [7, 99, 23, 5, 300]
    # A: prefill, then one decode step per token.
    a = Runner(model)
    a.run([([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 0, prompt)])
    steps = [a.run([([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], len(prompt) + i, [t])])[0]
             for i, t in enumerate(follow)]
    # B: prefill in two chunks, then one verify pass over all follow tokens, in a batch with
    #    two other sequences (one prefilling, one decoding) on other pages.
    b = Runner(model)
    table = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    b.run([(table, 0, prompt[:20]), ([40, 41], 0, [3, 4, 5])])
    b.run([(table, 20, prompt[20:]), ([40, 41], 3, [9])])
    verify = b.run([([50, 51, 52, 53, 54, 55, 56, 57, 58, 59], 0, list(range(100, 140))),
                    (table, len(prompt), follow), ([40, 41], 4, [11])])[1]
    for i, step in enumerate(steps):
        assert torch.equal(step[0], verify[i]), f"token {i}: verify and decode logits differ"
