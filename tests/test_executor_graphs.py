"""The executor's graph path on the CPU: uniform decode, verify and draft steps padded to
batch-size buckets (what CUDA graphs replay) produce exactly the tokens of the unpadded path."""

import pytest

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from runtime.engine import Engine
from runtime.messages import SamplingParams

PROMPTS = [[10 + i, 20 + 3 * i, 30, 40 + i][: 2 + i % 3] for i in range(11)]  # 11: pads to 16


def run(tiny_dirs, method: str, graphs: str, num_pages: int = 512):
    spec = SpecConfig(method=method, num_spec_tokens=3,
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
