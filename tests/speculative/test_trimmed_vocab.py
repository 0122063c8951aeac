"""A trimmed draft vocabulary (FR-Spec, SpecConfig.draft_vocab) changes speed and acceptance,
never the output: greedy equals plain decoding, and sampling keeps the target's law even
when the trimmed set excludes tokens the target produces."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, default_head_dir
from overlap.models.heads import load_head
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative.engine_stats import check_engine_law
from speculative.test_spec_engine import prompts


def trimmed_head(head_dir, tmp_path, ranked: list[int]):
    """A copy of the head with a token ranking (most frequent first)."""
    out = tmp_path / "trimmed"
    shutil.copytree(head_dir, out)
    save_file({"ranked_ids": torch.tensor(ranked, dtype=torch.int32)}, str(out / "token_ranks.safetensors"))
    return out


def engine(tiny_dirs, head, target, draft_vocab, k=3, **cache):
    spec = SpecConfig(controller="off", method="mtp", num_spec_tokens=k, head=str(head), draft_vocab=draft_vocab)
    return Engine(EngineConfig(model=str(tiny_dirs[target]), spec=spec, cache=CacheConfig(**cache),
                               scheduler=SchedulerConfig(max_num_seqs=1000, max_batched_tokens=8192)),
                  progress=False)


def test_the_head_scores_only_the_trimmed_tokens(tiny_dirs, heads, tmp_path):
    ranked = torch.randperm(49152, generator=torch.Generator().manual_seed(0)).tolist()
    head_dir = trimmed_head(heads["target"], tmp_path, ranked)
    eng = engine(tiny_dirs, head_dir, "target", draft_vocab=100)
    head = load_head(head_dir, eng.model, draft_vocab=100)
    logits = head.compute_logits(torch.randn(3, eng.model.cfg.hidden_size).to(eng.model.dtype))
    allowed = torch.zeros(49152, dtype=torch.bool)
    allowed[ranked[:100]] = True
    assert torch.isfinite(logits[:, allowed]).all() and torch.isinf(logits[:, ~allowed]).all()


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_trimmed_head_equals_plain(tiny_dirs, heads, greedy_reference, tmp_path, k):
    # The tiny prompts draw ids in [10, 49000): rank half of those first, so some of the
    # target's choices are outside the trimmed set and get rejected.
    ranked = list(range(10, 49152, 2)) + list(range(0, 10)) + list(range(11, 49152, 2))
    eng = engine(tiny_dirs, trimmed_head(heads["target"], tmp_path, ranked), "target", draft_vocab=4096, k=k)
    ps = prompts(4, seed=21)
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    assert sum(r.stats.get("draft_tokens", 0) for r in results) > 0


def test_sampling_with_a_trimmed_vocabulary_keeps_the_target_law(tiny_dirs, heads, tmp_path):
    """Vocab 6, the head drafts only tokens {0, 1, 2, 3}: drafts never propose 4 or 5, the
    residual draw must supply them at their full probability."""
    head_dir = trimmed_head(heads["target_v6"], tmp_path, [0, 1, 2, 3, 4, 5])
    eng = engine(tiny_dirs, head_dir, "target_v6", draft_vocab=4, k=3, num_pages=4096)
    check_engine_law(eng, SamplingParams(temperature=1.0), 4000, length=5, depth=3)


def test_a_head_drafts_with_its_own_vocabulary_unless_told(tiny_dirs, heads, tmp_path):
    """SpecConfig.draft_vocab None: the head's config.json decides (the size measured best for
    that head; 4,096 for the shipped one); 0 asks for every token; N for N."""
    ranked = torch.randperm(49152, generator=torch.Generator().manual_seed(1)).tolist()
    head_dir = trimmed_head(heads["target"], tmp_path, ranked)
    eng = engine(tiny_dirs, head_dir, "target", draft_vocab=0)
    assert load_head(head_dir, eng.model).vocab_ids is None  # the config names none: every token
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**config, "draft_vocab": 300}))
    assert len(load_head(head_dir, eng.model).vocab_ids) == 300
    assert load_head(head_dir, eng.model, draft_vocab=0).vocab_ids is None
    assert len(load_head(head_dir, eng.model, draft_vocab=50).vocab_ids) == 50
    # And the engine takes it when its spec names no size.
    default = Engine(EngineConfig(model=str(tiny_dirs["target"]), spec=SpecConfig(
        controller="off", method="mtp", num_spec_tokens=2, head=str(head_dir))), progress=False)
    try:
        assert len(default.executor.proposer.head.vocab_ids) == 300
    finally:
        default.close()


def test_the_shipped_head_drafts_with_4096_tokens():
    assert json.loads((default_head_dir() / "config.json").read_text())["draft_vocab"] == 4096
