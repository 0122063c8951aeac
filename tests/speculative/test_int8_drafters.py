"""Drafters with int8 weights (SpecConfig.drafter_weights = "int8") change how often drafts
are accepted, never the output: greedy equals plain decoding, sampling keeps the target's law,
and the drafter really runs the int8 kernel (its logits differ from the bf16 drafter's)."""

import pytest
import torch

from overlap import kernels
from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from overlap.models.llama import int8_linear, linear, load_llama
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative.engine_stats import check_engine_law
from speculative.test_spec_engine import prompts


def engine(tiny_dirs, heads, method, target="target", weights="int8", k=3, **scheduler) -> Engine:
    drafter = {"draft": dict(draft_model=str(tiny_dirs["draft" if target == "target" else "draft_v6"])),
               "mtp": dict(head=str(heads[target])), "eagle": dict(head=str(heads[target]))}[method]
    spec = SpecConfig(controller="off", method=method, num_spec_tokens=k, drafter_weights=weights, **drafter)
    return Engine(EngineConfig(model=str(tiny_dirs[target]), spec=spec,
                               cache=CacheConfig(num_pages=4096 if target == "target_v6" else 512),
                               scheduler=SchedulerConfig(**scheduler)), progress=False)


@pytest.mark.parametrize("method", ["draft", "mtp", "eagle"])
def test_greedy_with_int8_drafters_equals_plain(tiny_dirs, heads, greedy_reference, method):
    ps = prompts(4, seed=31)
    eng = engine(tiny_dirs, heads, method)
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    assert sum(r.stats.get("draft_tokens", 0) for r in results) > 0
    assert eng.stats()["free_pages"] == eng.stats()["total_pages"]
    # The target itself stays bf16: its matmuls never made an int8 copy of its own weights
    # (the lm_head it shares with a head may carry one, for the head's use).
    assert eng.model.linear is linear
    assert not any(hasattr(p, "_overlap_int8") for p in eng.model.layers.parameters())


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_int8_drafters_run_the_int8_kernel(tiny_dirs, heads, method):
    """The int8 drafter's logits are not the bf16 drafter's (a silent fallback to bf16 would
    pass every exactness test), and they are close to them."""
    logits = {}
    for weights in ("bf16", "int8"):
        proposer = engine(tiny_dirs, heads, method, weights=weights).executor.proposer
        drafter = proposer.draft.model if method == "draft" else proposer.head
        assert drafter.linear is (int8_linear if weights == "int8" else linear)
        hidden = torch.randn(5, drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        hidden = hidden.to(torch.bfloat16)
        logits[weights] = (proposer.draft.logits(hidden) if method == "draft" else drafter.compute_logits(hidden))
    finite = torch.isfinite(logits["bf16"])
    assert not torch.equal(logits["bf16"], logits["int8"])
    torch.testing.assert_close(logits["int8"][finite], logits["bf16"][finite], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_sampling_with_int8_drafters_keeps_the_target_law(tiny_dirs, heads, method):
    eng = engine(tiny_dirs, heads, method, target="target_v6", max_num_seqs=1000, max_batched_tokens=8192)
    check_engine_law(eng, SamplingParams(temperature=1.0), 4000, length=5, depth=3)


def test_auto_takes_int8_on_the_cpu_in_bf16_only(tiny_dirs, heads):
    """auto: int8 wherever the int8 kernel has a SIMD build (AVX2 and up), bf16 targets only."""
    spec = SpecConfig(controller="off", method="mtp", head=str(heads["target"]))
    assert spec.drafter_weights == "auto"
    bf16 = Engine(EngineConfig(model=str(tiny_dirs["target"]), spec=spec), progress=False)
    assert bf16.executor.proposer.head.linear is (int8_linear if kernels.variant() >= 0 else linear)
    f32 = Engine(EngineConfig(model=str(tiny_dirs["target"]), dtype="float32", spec=spec), progress=False)
    assert f32.executor.proposer.head.linear is linear


def test_int8_is_refused_for_targets_and_where_the_kernel_cannot_run(tiny_dirs, heads):
    with pytest.raises(ValueError, match="int8 is for drafters"):
        load_llama(tiny_dirs["target"], torch.bfloat16, matmul="int8")
    spec = SpecConfig(controller="off", method="mtp", head=str(heads["target"]), drafter_weights="int8")
    with pytest.raises(ValueError, match="drafter_weights int8 runs on the CPU with bf16"):
        Engine(EngineConfig(model=str(tiny_dirs["target"]), dtype="float32", spec=spec), progress=False)
    spec = SpecConfig(controller="off", method="mtp", head=str(heads["target"]), drafter_weights="int4")
    with pytest.raises(ValueError, match="must be auto, bf16 or int8"):
        Engine(EngineConfig(model=str(tiny_dirs["target"]), spec=spec), progress=False)
