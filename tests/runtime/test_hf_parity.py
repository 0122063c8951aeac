"""The real shipped model against transformers on the same weights (float32)."""

import pytest
import torch

from helpers import dense_forward
from overlap.config import EngineConfig
from runtime.engine import Engine
from runtime.hf_reference import HFReference
from runtime.messages import SamplingParams

CODE = 'def quicksort(items):\n    """Sort a list with quicksort and return a new list."""\n'
CHAT = "What is the tallest mountain in the world, and how tall is it?"


@pytest.fixture(scope="module")
def engines(smol_dir):
    ours = Engine(EngineConfig(model=str(smol_dir), dtype="float32"), progress=False)
    return ours, HFReference(smol_dir, "float32")


def test_logits_match_transformers(engines):
    ours, ref = engines
    ids = ours.encode(CODE)
    _, logits = dense_forward(ours.model, ids)
    with torch.no_grad():
        expected = ref.model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=2e-4)


@pytest.mark.slow  # 64 tokens of the shipped model, ours and transformers'
@pytest.mark.parametrize("prompt,chat", [(CODE, False), (CHAT, True)])
def test_greedy_generation_matches_transformers(engines, prompt, chat):
    ours, ref = engines
    result = ours.generate([prompt], SamplingParams(max_tokens=64), chat=chat)[0]
    expected = ref.generate(ours.encode(prompt, chat=chat), 64)
    assert len(result.token_ids) == 64 or result.finish_reason == "stop"
    assert result.token_ids == expected
