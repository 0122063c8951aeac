"""The executor's graph path on the CPU: uniform decode, verify and draft steps padded to
batch-size buckets (what CUDA graphs replay) produce exactly the tokens of the unpadded path."""

import pytest

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from runtime.engine import Engine
from runtime.messages import SamplingParams

PROMPTS = [[10 + i, 20 + 3 * i, 30, 40 + i][: 2 + i % 3] for i in range(11)]  # 11: pads to 16


def run(tiny_dirs, method: str, graphs: str, num_pages: int = 512):
    spec = SpecConfig(controller="off", method=method, num_spec_tokens=3,
                      draft_model=str(tiny_dirs["draft"]) if method == "draft" else None)
    eng = Engine(EngineConfig(model=str(tiny_dirs["target"]), spec=spec, graphs=graphs,
                              cache=CacheConfig(page_size=16, num_pages=num_pages),
                              scheduler=SchedulerConfig(max_num_seqs=16)), progress=False)
    out = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))]
    return eng, out


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_padded_graph_path_gives_identical_tokens(tiny_dirs, method):
    plain, expected = run(tiny_dirs, method, "off")
    padded, got = run(tiny_dirs, method, "on")
    assert got == expected
    assert not plain.executor.graphs and plain.executor.scratch_page is None
    # The graph path really ran: a runner per q_len seen (1 = decode, 4 = verify of k = 3).
    assert padded.executor.graphs
    if method == "draft":
        assert padded.executor.proposer.step_runner is not None
    # The scratch page is outside the scheduler's pages and never handed out.
    assert padded.executor.kv.num_pages == padded.allocator.num_pages + 1
    for eng in (plain, padded):
        eng.close()


def test_graph_path_with_preemption(tiny_dirs):
    _, expected = run(tiny_dirs, "draft", "off")
    eng, got = run(tiny_dirs, "draft", "on", num_pages=12)
    assert got == expected and eng.scheduler.num_preemptions > 0
    eng.close()


def test_bad_graphs_setting():
    with pytest.raises(ValueError, match="graphs must be"):
        EngineConfig(graphs="sometimes").use_graphs


def test_every_bucket_is_set_up_at_start_up_and_logged(tiny_dirs, caplog):
    """Start-up sets up every bucket of every runner (target q_len 1..k+1, the draft's
    single-token steps) in one shared pool and logs each with its time; on the CPU each says
    it runs eagerly and why. Serving then creates no runner and sets up no bucket."""
    import logging

    from overlap.graphs import DEFAULT_BUCKETS

    with caplog.at_level(logging.INFO, logger="overlap"):
        eng = Engine(EngineConfig(model=str(tiny_dirs["target"]), graphs="on",
                                  spec=SpecConfig(controller="off", method="draft", num_spec_tokens=3, draft_model=str(tiny_dirs["draft"])),
                                  cache=CacheConfig(page_size=16, num_pages=512),
                                  scheduler=SchedulerConfig(max_num_seqs=16)), progress=False)
        eng.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    report = {(r["name"], r["q_len"]): r for r in eng.executor.graph_report}
    assert set(report) == {("target", 1), ("target", 2), ("target", 3), ("target", 4), ("draft", 1)}
    assert all(r["buckets"] == list(DEFAULT_BUCKETS) and r["captured"] == [] and "no CUDA device" in r["eager"]
               for r in report.values())
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("overlap.")]
    assert sum("EAGER, not captured (no CUDA device" in m for m in lines) == 5, lines
    assert any("start-up set-up of 5 runners" in m for m in lines), lines
    assert not any("captured at start-up" in m for m in lines), lines
    runners = [*eng.executor.graphs.values(), eng.executor.proposer.step_runner]
    assert sorted(eng.executor.graphs) == [1, 2, 3, 4]  # serving added none
    assert all(set(r._buckets) == set(DEFAULT_BUCKETS) for r in runners)
    assert len({id(r.pool) for r in runners}) == 1  # one pool (None on the CPU: nothing captured)
    eng.close()


def test_graphs_on_fails_loudly_when_capture_is_impossible(tiny_dirs, monkeypatch):
    """graphs = "on" on CUDA with a backend that cannot be captured: an error at start-up,
    not a silent eager run (the CUDA device is faked: the check runs before any capture)."""
    from overlap.executor import Executor

    monkeypatch.setattr("overlap.device.Device.__init__", _fake_cuda_device)
    monkeypatch.setattr(Executor, "settle", lambda self: None)
    with pytest.raises(RuntimeError, match="cannot be captured: target q_len=1: no CUDA device"):
        run(tiny_dirs, "none", "on")


def _fake_cuda_device(self, device="cpu"):
    import torch

    from overlap.device import CpuStream

    self.torch_device, self.is_cuda = torch.device(device), True
    self.forward, self.copy = CpuStream("forward"), CpuStream("copy")
