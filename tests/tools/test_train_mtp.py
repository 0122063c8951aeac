"""tools/train_mtp.py on a tiny random target: it learns, resumes exactly, trains the ablation."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import hf_model, our_model, save_hf_dir, tiny_hf_config
from overlap.attention import ReferenceBackend, SeqAttention
from overlap.models.heads import load_head
from overlap.models.llama import load_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import train_mtp  # noqa: E402

VOCAB, PAGE = 512, 16


@torch.inference_mode()
def greedy_windows(model, count: int, prompt_len: int, length: int, seed: int) -> list[list[int]]:
    """The target's own greedy continuations of random prompts (all sequences each step)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(3, VOCAB, (count, prompt_len), generator=gen).tolist()
    backend = ReferenceBackend()
    pages = -(-length // PAGE)
    for n in range(prompt_len, length):
        kv = model.new_kv_pool(count * pages, PAGE)
        meta = backend.plan([SeqAttention(n, n, list(range(i * pages, (i + 1) * pages))) for i in range(count)], PAGE)
        last = torch.arange(count) * n + n - 1
        _, logits = model(torch.tensor(seqs).flatten(), torch.arange(n).repeat(count), backend, kv, meta, last)
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t)
    return seqs


def cycle_windows(count: int, length: int, seed: int) -> list[list[int]]:
    """Short cycles over 40 tokens: the target's next token there is a function of the last
    few, which one layer that sees H and the token can learn in a few hundred steps."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(VOCAB - 3, generator=gen)[:40] + 3
    out = []
    for _ in range(count):
        cycle = tokens[torch.randint(40, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen)].tolist()
        out.append([cycle[i % len(cycle)] for i in range(length)])
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target (vocab 512, no tokenizer needed with --windows) and token windows:
    cycles (learnable, but not what the target would say) and the target's own greedy
    continuations of random prompts (on its path, so the chained metrics have starts to score;
    a random model soon repeats one token, easy for any head)."""
    root = tmp_path_factory.mktemp("train_mtp")
    cfg = tiny_hf_config(vocab=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2)
    hf = hf_model(cfg, seed=0)
    with torch.no_grad():  # sharper next-token distributions: fewer near-ties for argmax to flip on
        hf.model.embed_tokens.weight.mul_(4)
    target_dir = save_hf_dir(hf, cfg, root / "target")
    model = our_model(hf, cfg, torch.bfloat16)
    windows = {"train": cycle_windows(96, 33, seed=1) + greedy_windows(model, 32, 4, 33, seed=2),
               "eval": cycle_windows(24, 33, seed=3) + greedy_windows(model, 8, 4, 33, seed=4)}
    (root / "windows.json").write_text(json.dumps(windows))
    return root, target_dir


def run(setup, name, *extra):
    root, target_dir = setup
    argv = ["--tiny-target", str(target_dir), "--windows", str(root / "windows.json"),
            "--out", str(root / name), "--workdir", str(root / f"work_{name}"),
            "--seq-len", "32", "--batch-size", "8", "--lr", "3e-3", "--warmup", "10", "--loss-vocab", "0",
            "--ckpt-every", "10", *extra]
    assert train_mtp.main(argv) == 0
    report = root / name / "train_report.json"
    return json.loads(report.read_text()) if report.exists() else None


@pytest.mark.slow  # 200 training steps
def test_short_training_learns_the_targets_next_tokens(setup):
    # From the random start (EAGLE's): a target-layer start already gets most of these right.
    report = run(setup, "trained", "--steps", "200", "--lr", "1e-2")
    curve = report["train"]["curve"]
    assert curve[-1]["loss"] < 0.5 * curve[0]["loss"]
    before, after = report["before_training"], report["held_out"]
    assert before["top1"] < 0.1 and after["top1"] > 0.4
    assert after["top1"] > after["majority_baseline"] + 0.3  # clearly better than guessing
    # Chains: scored on the target's own path, prefix matches can only shrink with depth.
    assert after["chain_starts"] > 0 and len(after["chain_prefix_match"]) == 3
    prefix = after["chain_prefix_match"]
    assert prefix[0] >= prefix[1] >= prefix[2]
    assert after["expected_acceptance_length"] == pytest.approx(1 + sum(prefix))
    assert after["expected_acceptance_length"] > before["expected_acceptance_length"] + 1
    assert report["data"]["train_windows"] == 128 and report["data"]["eval_tokens"] == 32 * 33
    # The export loads as an inference head for the target, with only the head's weights in it.
    root, target_dir = setup
    head = load_head(root / "trained", load_llama(target_dir, torch.bfloat16))
    assert head.norms and head.cfg.num_layers == 1
    assert not any("embed_tokens" in k for k in load_file(str(root / "trained" / "model.safetensors")))


@pytest.mark.slow  # two training runs, one resumed
def test_resume_continues_exactly(setup):
    straight = run(setup, "straight", "--steps", "30")
    assert run(setup, "resumed", "--steps", "30", "--stop-after", "20") is None  # interrupted at 20
    root = setup[0]
    assert not (root / "resumed" / "model.safetensors").exists()
    resumed = run(setup, "resumed", "--steps", "30", "--resume")
    assert resumed["train"]["curve"] == straight["train"]["curve"]
    a = load_file(str(root / "straight" / "model.safetensors"))
    b = load_file(str(root / "resumed" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit, match="other settings"):
        run(setup, "resumed", "--steps", "30", "--resume", "--lr", "1e-3")


def test_no_norms_ablation_trains(setup):
    report = run(setup, "no_norms", "--steps", "20", "--no-norms")
    assert report["variant"] == "no_norms" and report["norms"] is False
    cfg = json.loads((setup[0] / "no_norms" / "config.json").read_text())
    assert cfg["norms"] is False and cfg["head_type"] == "mtp"
    assert not any("norm_" in k for k in load_file(str(setup[0] / "no_norms" / "model.safetensors")))


def test_engine_validation_hook_needs_the_mtp_proposer(setup, monkeypatch):
    monkeypatch.setitem(sys.modules, "overlap.speculative.mtp", None)  # as if the module did not exist
    with pytest.raises(NotImplementedError, match="overlap.speculative.mtp"):
        train_mtp.validate_with_engine(setup[0] / "trained", ["hi"])


def test_engine_validation_device_is_checked_before_training(setup):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        train_mtp.main(["--out", str(setup[0] / "never"), "--engine-validate", "2",
                        "--attention-backend", "flashinfer"])
    assert not (setup[0] / "never").exists()


def test_training_continues_from_an_exported_head(setup):
    """--init-head starts from an exported head's weights: with a zero learning rate the
    continued run exports exactly the head it started from; a head of another layout is refused."""
    root = setup[0]
    run(setup, "base", "--steps", "5")
    continued = run(setup, "continued", "--steps", "2", "--lr", "0", "--init-head", str(root / "base"))
    assert continued["train"]["init"] == f"head {root / 'base'}"
    a = load_file(str(root / "base" / "model.safetensors"))
    b = load_file(str(root / "continued" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit, match="norms"):
        run(setup, "mismatch", "--steps", "2", "--no-norms", "--init-head", str(root / "base"))
