"""Tensor parallelism on the CPU (gloo, 2 processes): the sharded forward equals the
unsharded one within fp32 tolerance, for even and uneven head/vocab splits, and each rank
holds only its share of the weights."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from helpers import hf_model, random_head, save_hf_dir, tiny_hf_config
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


def tp_engine(model_dir, world, **kw):
    from overlap.config import EngineConfig
    from runtime.engine import Engine

    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", tensor_parallel=world, **kw), progress=False)


def generate(model_dir, world, prompts, params, **kw):
    """Results of one engine (tensor_parallel=world) over the prompts, closing it after."""
    eng = tp_engine(model_dir, world, **kw)
    try:
        return eng.generate(prompts, params)
    finally:
        eng.close()


def token_ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def uneven_model(tmp_path_factory, smol_dir):
    cfg = tiny_hf_config(vocab=49152, hidden=48, heads=6, kv_heads=3, layers=2, intermediate=96)
    return save_hf_dir(hf_model(cfg, seed=5), cfg, tmp_path_factory.mktemp("tp") / "m", tokenizer_dir=smol_dir)


def test_tp2_engine_greedy_equals_tp1(uneven_model):
    from runtime.messages import SamplingParams

    prompts = [[5, 17, 3, 9, 40, 2], [11, 7, 23], list(range(100, 130))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = token_ids(generate(uneven_model, 1, prompts, params))
    assert token_ids(generate(uneven_model, 2, prompts, params)) == want


def test_a_dead_rank_fails_the_step_instead_of_hanging(uneven_model):
    import time

    from overlap.device import DeviceError
    from runtime.messages import SamplingParams

    eng = tp_engine(uneven_model, 2, tp_timeout_s=10.0)
    try:
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        follower = eng.executor.followers[0]
        follower.kill()
        follower.join(10)
        eng.add_request([8, 9, 10], SamplingParams(max_tokens=8))
        start = time.monotonic()
        with pytest.raises((DeviceError, RuntimeError)):
            for _ in range(10):
                eng.step()
        assert time.monotonic() - start < 30
    finally:
        with pytest.raises(Exception):  # telling the dead rank to stop fails too; the group goes down
            eng.executor.close()


@pytest.fixture(scope="module")
def uneven_draft(tmp_path_factory, smol_dir):
    cfg = tiny_hf_config(vocab=49152, hidden=48, heads=6, kv_heads=3, layers=1, intermediate=96)
    return save_hf_dir(hf_model(cfg, seed=6), cfg, tmp_path_factory.mktemp("tpd") / "d")


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tp2_draft_target_equals_tp1(uneven_model, uneven_draft, temperature):
    """The draft on the leader only, its drafts broadcast: same tokens as TP=1, greedy and
    sampled (counter-based noise: the same draws on every rank and in every layout)."""
    from overlap.config import SpecConfig
    from runtime.messages import SamplingParams

    spec = SpecConfig(controller="off", method="draft", num_spec_tokens=3, draft_model=str(uneven_draft))
    prompts = [[5, 17, 3, 9, 40, 2], [11, 7, 23]]
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=temperature, seed=7)
    want = token_ids(generate(uneven_model, 1, prompts, params, spec=spec))
    results = generate(uneven_model, 2, prompts, params, spec=spec)
    assert token_ids(results) == want
    assert sum(r.stats.get("drafts", 0) for r in results) > 0


@pytest.mark.slow  # the daemon's processes and two TP workers
@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_tp2_through_the_daemon(uneven_model, uneven_draft, tmp_path, method):
    from overlap.config import EngineConfig, SpecConfig
    from runtime.client import Client
    from runtime.daemon import Daemon
    from runtime.messages import SamplingParams

    spec = SpecConfig(controller="off", method="draft", num_spec_tokens=3, draft_model=str(uneven_draft)) if method == "draft" else \
        SpecConfig(controller="off", method="mtp", num_spec_tokens=1, head=str(random_head(uneven_model, tmp_path / "head")))
    prompts = [[5, 17, 3, 9, 40, 2], [11, 7, 23], [42] * 7]
    want = token_ids(generate(uneven_model, 1, prompts, SamplingParams(max_tokens=16, ignore_eos=True)))
    config = EngineConfig(model=str(uneven_model), dtype="float32", tensor_parallel=2, spec=spec)
    with Daemon(config, "tcp://127.0.0.1:*", ready_timeout_s=300) as d, Client(d.endpoint, timeout=120) as c:
        for spec_on in (True, False):
            got = [c.generate(p, max_tokens=16, ignore_eos=True, spec=spec_on).token_ids for p in prompts]
            assert got == want


@pytest.mark.parametrize("k", [1, 3])
def test_tp2_mtp_head_sharded_with_the_target(uneven_model, tmp_path, k):
    from overlap.config import SpecConfig
    from runtime.messages import SamplingParams

    head = random_head(uneven_model, tmp_path / "head")
    spec = SpecConfig(controller="off", method="mtp", num_spec_tokens=k, head=str(head))
    prompts = [[5, 17, 3, 9, 40, 2], [11, 7, 23]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = token_ids(generate(uneven_model, 1, prompts, params))
    results = generate(uneven_model, 2, prompts, params, spec=spec)
    assert token_ids(results) == want
    assert sum(r.stats.get("drafts", 0) for r in results) > 0


@pytest.mark.slow  # the shipped model in two TP workers
def test_tp2_real_model_greedy_equals_tp1(smol_dir):
    """The shipped SmolLM2 (9 heads, 3 KV heads: shards of 2 and 1) on two prompts, fp32."""
    from runtime.messages import SamplingParams

    prompts = ["def fibonacci(n):", "The capital of France is"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = token_ids(generate(smol_dir, 1, prompts, params))
    assert token_ids(generate(smol_dir, 2, prompts, params)) == want


def test_tp_draft_path_builds_every_tensor_on_the_rank_device(tiny_dirs):
    """The leader's draft under TP is built around `full_embeddings`; every tensor of it (the
    holder's embeddings, the draft's layers, its lm_head rows, its KV pool, the graph runner's
    buffers) must be on the rank's device. Checked on the meta device: a tensor left on the
    CPU shows up as "cpu" (on a GPU it failed the first propose with a device mismatch)."""
    from overlap.config import CacheConfig, EngineConfig, SpecConfig
    from overlap.speculative.build import build_proposer
    from overlap.tp_group import full_embeddings

    meta = torch.device("meta")
    holder = full_embeddings(str(tiny_dirs["target"]), torch.bfloat16, meta)
    config = EngineConfig(model=str(tiny_dirs["target"]), device="cpu", attention_backend="reference",
                          spec=SpecConfig(controller="off", method="draft", num_spec_tokens=3, draft_model=str(tiny_dirs["draft"])),
                          cache=CacheConfig(page_size=16, num_pages=8))
    proposer = build_proposer(config, holder, scratch_page=8)
    tensors = {f"holder.{n}": t for n, t in holder.state_dict().items()}
    tensors |= {f"draft.{n}": t for n, t in proposer.draft.model.state_dict().items()}
    tensors["draft.lm_head"] = proposer.draft.lm_head
    tensors |= {f"kv.k{i}": t for i, t in enumerate(proposer.kv.k + proposer.kv.v)}
    tensors["graph_runner.dummy_positions"] = proposer.step_runner._dummy_positions
    tensors |= {f"{n}.{a}": getattr(o, a) for n, o in (("holder", holder), ("draft", proposer.draft.model))
                for a in vars(o) if isinstance(getattr(o, a), torch.Tensor)}
    rope = getattr(proposer.draft.model, "rope", None)
    if rope is not None:
        tensors |= {"draft.rope.cos": rope.cos, "draft.rope.sin": rope.sin}
    wrong = {n: str(t.device) for n, t in tensors.items() if t.device != meta}
    assert len(tensors) > 10 and not wrong, wrong
