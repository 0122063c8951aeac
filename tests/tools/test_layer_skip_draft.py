"""tools/layer_skip_draft.py on a tiny 4-layer target: the shared-prefix search scores what a
direct run of each subset scores, and the exported copy is the target's own layers, which the
engine runs as a lossless draft."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from overlap.config import SpecConfig
from overlap.models.llama import load_llama
from overlap.speculative.draft_target import load_draft
from helpers import hf_model, save_hf_dir, tiny_hf_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import layer_skip_draft  # noqa: E402
from test_head_data import greedy_equals_plain  # noqa: E402


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smol_dir):
    cfg = tiny_hf_config(vocab=49152, layers=4, hidden=64, heads=4, kv_heads=2)
    return save_hf_dir(hf_model(cfg, seed=7), cfg, tmp_path_factory.mktemp("skip") / "target", tokenizer_dir=smol_dir)


def _windows(target, count=3, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return layer_skip_draft._labelled(target, [torch.randint(0, 49152, (length,), generator=g).tolist()
                                               for _ in range(count)])


def test_all_layers_agree_fully_and_the_shared_prefix_search_scores_each_subset_as_a_direct_run(target_dir, tmp_path):
    target = load_llama(target_dir, torch.bfloat16)
    windows = _windows(target)
    agree = layer_skip_draft.Agreement(target, torch.arange(target.cfg.vocab_size))
    assert agree.of(windows, [0, 1, 2, 3]) == 1.0  # the whole target is its own labels
    layers = [0, 1, 2, 3]
    dropped = agree.without_each(windows, layers)
    assert dropped == [agree.of(windows, layers[:p] + layers[p + 1:]) for p in range(4)]
    assert min(dropped) < 1.0  # dropping a layer of a random model changes some argmax
    # A copy exported and loaded as a draft model scores what the search scored for its layers.
    layer_skip_draft.export(target, json.loads((target_dir / "config.json").read_text()), [0, 2],
                            torch.arange(target.cfg.vocab_size), tmp_path / "copy", {})
    assert layer_skip_draft.draft_agreement(target, str(tmp_path / "copy"), windows) == agree.of(windows, [0, 2])


def test_a_copy_of_a_target_with_attention_biases_keeps_them(tmp_path):
    cfg = tiny_hf_config(vocab=49152, layers=3, hidden=64, heads=4, kv_heads=2, bias=True)
    target_dir = save_hf_dir(hf_model(cfg, seed=3), cfg, tmp_path / "biased")
    target = load_llama(target_dir, torch.bfloat16)
    assert target.layers[0].qkv_bias is not None
    windows = _windows(target, count=2)
    agree = layer_skip_draft.Agreement(target, torch.arange(target.cfg.vocab_size))
    layer_skip_draft.export(target, cfg, [0, 2], torch.arange(target.cfg.vocab_size), tmp_path / "copy", {})
    assert torch.equal(load_draft(tmp_path / "copy", target).model.layers[1].qkv_bias, target.layers[2].qkv_bias)
    assert layer_skip_draft.draft_agreement(target, str(tmp_path / "copy"), windows) == agree.of(windows, [0, 2])


def test_the_tool_exports_copies_of_the_chosen_layers_that_draft_losslessly(target_dir, tiny_dirs, tmp_path, capsys):
    out = tmp_path / "skip"
    argv = ["--model", str(target_dir), "--out", str(out), "--keep", "1", "3", "--tokens", "96", "--window", "32",
            "--compare", str(tiny_dirs["draft"])]
    assert layer_skip_draft.main(argv) == 0
    summary = json.loads((out / "curve.json").read_text())
    assert [len(p["layers"]) for p in summary["curve"]] == [4, 3, 2, 1]
    assert summary["search_tokens"] > 0 and summary["report_tokens"] > 0
    assert (out / "curve.png").stat().st_size > 0
    # A trained draft (here tiny_dirs' 1-layer one), scored on the same report set.
    (layers, top1), = summary["reference"].values()
    assert layers == 1 and 0.0 <= top1 <= 1.0
    target = load_llama(target_dir, torch.bfloat16)
    shipped_vocab = load_file(str(layer_skip_draft.SHIPPED_DRAFT / "model.safetensors"))["vocab_ids"]
    for n in (1, 3):
        report = json.loads((out / str(n) / "layer_skip_report.json").read_text())
        kept = report["kept"]
        assert len(kept) == n
        draft = load_draft(out / str(n), target)
        assert torch.equal(draft.vocab_ids, shipped_vocab.long())
        for j, i in enumerate(kept):  # the copy is the target's own weights, in order
            assert torch.equal(draft.model.layers[j].qkv_proj, target.layers[i].qkv_proj)
            assert torch.equal(draft.model.layers[j].down_proj, target.layers[i].down_proj)
    # Another layer count from the same search: exported from curve.json, no new search.
    capsys.readouterr()
    assert layer_skip_draft.main([*argv[:6], "2", *argv[7:]]) == 0
    assert "reusing the search" in capsys.readouterr().out
    assert json.loads((out / "2" / "layer_skip_report.json").read_text())["kept"] == summary["curve"][2]["layers"]
    greedy_equals_plain({"target": target_dir}, SpecConfig(method="draft", num_spec_tokens=3, draft_model=str(out / "3")))
