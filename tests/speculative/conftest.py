"""Fixtures shared by the speculative-decoding tests."""

import pytest

from helpers import random_head
from overlap.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.messages import SamplingParams


@pytest.fixture(scope="module")
def heads(tiny_dirs, tmp_path_factory):
    """Random MTP heads for the tiny targets (by target name)."""
    root = tmp_path_factory.mktemp("heads")
    return {"target": random_head(tiny_dirs["target"], root / "h"),
            "target_v6": random_head(tiny_dirs["target_v6"], root / "h6", seed=1)}


@pytest.fixture(scope="module")
def greedy_reference(tiny_dirs):
    """run(prompts, max_tokens) → the tiny target's greedy token ids without speculation."""
    base = Engine(EngineConfig(model=str(tiny_dirs["target"]), cache=CacheConfig(page_size=16, num_pages=512),
                               scheduler=SchedulerConfig(max_num_seqs=64, max_batched_tokens=512)), progress=False)
    cache = {}

    def run(ps, max_tokens):
        key = (tuple(map(tuple, ps)), max_tokens)
        if key not in cache:
            cache[key] = [r.token_ids for r in base.generate(ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
        return cache[key]
    return run
