"""The shipped model with the shipped draft and with n-gram drafts: greedy speculative output
equals plain greedy output token for token (bf16, the CPU default)."""

import pytest

from overlap.config import EngineConfig, SpecConfig, default_draft_dir
from runtime.engine import Engine
from runtime.messages import SamplingParams

PROMPTS = [
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
]
PARAMS = SamplingParams(max_tokens=40)
pytestmark = pytest.mark.slow  # the shipped model end to end (the tiny models cover the same paths quickly)


@pytest.fixture(scope="module")
def plain(smol_dir):
    engine = Engine(EngineConfig(model=str(smol_dir)), progress=False)
    return [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("spec", [
    SpecConfig(controller="off", method="draft", num_spec_tokens=4, draft_model=str(default_draft_dir())),
    SpecConfig(controller="off", method="ngram", num_spec_tokens=4),
])
def test_shipped_drafters_keep_greedy_output(smol_dir, plain, spec):
    engine = Engine(EngineConfig(model=str(smol_dir), spec=spec), progress=False)
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == plain
    accepted = sum(r.stats.get("accepted_tokens", 0) for r in results)
    assert accepted > 0  # the drafters were exercised, not bypassed
    if spec.method == "draft":
        # Same prompts one at a time: batch size does not change a token.
        assert [engine.generate([p], PARAMS)[0].token_ids for p in PROMPTS[:2]] == plain[:2]
