"""Tensor parallelism on the CPU (gloo, 2 processes): the sharded forward equals the
unsharded one within fp32 tolerance, for even and uneven head/vocab splits, and each rank
holds only its share of the weights."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from helpers import hf_model, save_hf_dir, tiny_hf_config
from overlap.models.llama import load_llama

TESTS = Path(__file__).resolve().parents[1]


def run_ranks(fn, world: int, *args) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    mp.start_processes(fn, args=(world, *args), nprocs=world, join=True, start_method="spawn")


@pytest.mark.parametrize("heads,kv_heads,vocab,tie", [(4, 2, 96, True), (6, 3, 101, False)])
def test_sharded_forward_matches_unsharded(tmp_path, heads, kv_heads, vocab, tie):
    sys.path.insert(0, str(TESTS))
    import tp_worker

    cfg = tiny_hf_config(vocab=vocab, hidden=48, heads=heads, kv_heads=kv_heads, layers=2, tie=tie,
                         intermediate=100)
    model_dir = save_hf_dir(hf_model(cfg, seed=3), cfg, tmp_path / "m")
    out = tmp_path / "rank0.pt"
    run_ranks(tp_worker.sharded_logits, 2, str(model_dir), f"file://{tmp_path / 'rdzv'}", str(out))
    got = torch.load(out)
    want = tp_worker.run_prompts(load_llama(model_dir, torch.float32))
    torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)
    assert got["kv_heads"] == -(-kv_heads // 2) and got["vocab"] == -(-vocab // 2)
    full = sum(p.numel() for p in load_llama(model_dir, torch.float32).parameters())
    assert got["params"] < 0.7 * full  # rank 0 holds about half (norms are replicated)
