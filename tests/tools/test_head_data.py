"""tools/head_data.py end to end on a tiny target (SmolLM2's tokenizer, 2 random layers): the
corpus is built by the engine, the states are the target's own and resume bit for bit, and
tools/train_mtp.py trains a multi-layer head with the training-time test on it, which the
engine then runs losslessly; tools/distill_draft.py distils a draft model on the same corpus."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from overlap.config import EngineConfig, SpecConfig
from overlap.models.heads import load_head
from overlap.models.llama import load_llama
from runtime.engine import Engine
from runtime.messages import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import distill_draft  # noqa: E402
import head_data  # noqa: E402
import train_mtp  # noqa: E402

SMALL = ["--code-train-tokens", "3000", "--code-eval-tokens", "800", "--chat-instructions", "20",
         "--chat-tokens", "16", "--code-headers", "8", "--code-tokens", "16", "--batch", "8", "--chunk", "4",
         "--window", "65"]


def greedy_equals_plain(tiny_dirs, spec: SpecConfig) -> Engine:
    """Asserts that the tiny target decodes the same tokens greedily with this drafter as
    without; returns the (closed) speculating engine for further checks."""
    prompts = ["def add(a, b):", "The capital of France is"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outputs = []
    for config in (SpecConfig(method="none"), spec):
        engine = Engine(EngineConfig(model=str(tiny_dirs["target"]), spec=config), progress=False)
        try:
            outputs.append([r.token_ids for r in engine.generate(prompts, params)])
        finally:
            engine.close()
    assert outputs[1] == outputs[0]
    return engine


@pytest.fixture(scope="module")
def data(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("head_data") / "data"
    assert head_data.main(["--model", str(tiny_dirs["target"]), "--out", str(out), *SMALL]) == 0
    return out


def test_corpus_and_states(data, tiny_dirs):
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["feature_layers"] == [0, 1]  # low/middle/high of a 2-layer target, deduplicated
    for key in ("code/train", "code/eval", "chat/train", "chat/eval", "gen_code/train", "chat_more/train"):
        part = manifest["parts"][key]
        assert part["tokens"] > 0 and part["states_done"] == part["chunks"]
    target = load_llama(tiny_dirs["target"], torch.bfloat16)
    chat = head_data.HeadData(data, "chat", "train")
    assert len(chat) >= 18  # one greedy reply per training instruction (18 of 20), cut in windows
    # The stored states are the target's: H is the final norm of the last feature layer's output.
    hidden, features = chat.rows(0, 40)
    assert hidden.dtype == torch.bfloat16 and features.shape == (40, 2 * target.cfg.hidden_size)
    with torch.inference_mode():
        assert torch.equal(target.norm(features[:, -target.cfg.hidden_size:]), hidden)
    # The replies are the target's own greedy continuations: argmax lm_head(H_j) = x_{j+1}
    # inside the reply (a window of a chat sequence ends in its reply).
    ids = chat.ids[: int(chat.offsets[1])]
    h, _ = chat.rows(0, len(ids))
    with torch.inference_mode():
        greedy = target.compute_logits(h).argmax(-1)
    assert torch.equal(greedy[-8:-1], ids[-7:])


def test_the_second_chat_part_asks_other_instructions_with_other_seeds():
    args = head_data.parse_args(["--out", "unused"])
    for split in head_data.SPLITS:
        chat, more = (head_data.requests_for(part, split, args) for part in ("chat", "chat_more"))
        assert len(more) > 250 and not {q for q, _, _ in chat} & {q for q, _, _ in more}
        assert [o["temperature"] for _, o, _ in more].count(0.0) == len(more) // 2  # greedy + 1 sample each
        seeds = [{o["seed"] for _, o, _ in requests if "seed" in o} for requests in (chat, more)]
        assert not seeds[0] & seeds[1]  # a sampled reply is not the other part's sample again


def test_the_second_chat_part_skips_what_we_measure_on_and_keeps_the_other_seeds(monkeypatch):
    args = head_data.parse_args(["--out", "unused"])
    kept = head_data.requests_for("chat_more", "train", args)
    monkeypatch.setattr(head_data, "too_close_to_evaluation", lambda x: False)
    every = head_data.requests_for("chat_more", "train", args)
    assert len(every) * 0.7 < len(kept) < len(every)  # a fifth or so is skipped...
    assert all(r in every for r in kept)  # ...and the rest are the same requests, seeds included
    from make_prompts import CHAT_INSTRUCTIONS

    asked = {q for q, _, _ in kept}
    for shape in ("Translate the sentence", "What is the difference between", "Give three reasons why"):
        assert not any(q.startswith(shape) for q in asked)  # the dev set's shapes
    assert not asked & set(CHAT_INSTRUCTIONS)
    assert "Write a short poem about the first snow of winter." not in asked  # a held-out one, reworded
    with pytest.raises(SystemExit, match="at most"):
        head_data.requests_for("chat", "train", head_data.parse_args(["--out", "x", "--chat-samples", "8"]))


def test_distill_draft_trains_on_a_part_with_no_held_out_split_yet(tmp_path):
    args = distill_draft.parse_args(["--out", "unused", "--data", str(tmp_path)])
    (tmp_path / "chat_more" / "train").mkdir(parents=True)
    head_data.save_windows(tmp_path / "chat_more" / "train" / "chunk_0000.pt", [[1, 2, 3]])
    assert distill_draft.part_names(args) == ("chat_more",)
    assert distill_draft.data_windows(tmp_path, "chat_more", "eval", args) == []
    # Cached labels name the chunks they came from: one more chunk and they are made again.
    before = distill_draft.data_source(args, "chat_more", "train")
    head_data.save_windows(tmp_path / "chat_more" / "train" / "chunk_0001.pt", [[4, 5, 6]])
    assert distill_draft.data_source(args, "chat_more", "train") != before


def test_states_resume_bit_for_bit(data, tiny_dirs):
    chunk = sorted((data / "code" / "train").glob("chunk_*.pt"))[0]
    before = chunk.with_suffix(".features").read_bytes(), chunk.with_suffix(".hidden").read_bytes()
    chunk.with_suffix(".features").unlink()  # as if the run was killed before this chunk finished
    assert head_data.main(["--model", str(tiny_dirs["target"]), "--out", str(data), "--stage", "states", *SMALL]) == 0
    assert (chunk.with_suffix(".features").read_bytes(), chunk.with_suffix(".hidden").read_bytes()) == before


@pytest.mark.parametrize("features,ttt", [("multi", "2"), ("last", "1")])
def test_train_on_data_and_run_the_head_losslessly(data, tiny_dirs, tmp_path, features, ttt):
    out = tmp_path / "head"
    argv = ["--model", str(tiny_dirs["target"]), "--data", str(data), "--out", str(out),
            "--workdir", str(tmp_path / "work"), "--steps", "6", "--batch-size", "2", "--crop", "32",
            "--loss-vocab", "512", "--warmup", "2", "--ckpt-every", "3", "--features", features, "--ttt-depth", ttt]
    assert train_mtp.main(argv) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["features"]["kind"] == features and report["training_time_test"]["depth"] == int(ttt)
    per_depth = [k for k in report["train"]["final"] if k.startswith("acc") and k[3:].isdigit()]
    assert per_depth == [f"acc{d}" for d in range(1, int(ttt) + 1)]  # a loss and accuracy per depth
    assert report["data"]["by_part"]["chat"]["train"] > 0
    target = load_llama(tiny_dirs["target"], torch.bfloat16)
    head = load_head(out, target)
    assert head.feature_layers == ((0, 1) if features == "multi" else ())
    # Lossless in the engine: greedy output with the head drafting equals plain decoding.
    engine = greedy_equals_plain(tiny_dirs, SpecConfig(method="mtp", num_spec_tokens=3, head=str(out)))
    assert engine.model.feature_layers == head.feature_layers


def test_distill_a_draft_on_the_same_data_and_run_it_losslessly(data, tiny_dirs, tmp_path):
    out, work = tmp_path / "draft", tmp_path / "work"
    argv = ["--model", str(tiny_dirs["target"]), "--data", str(data), "--out", str(out), "--workdir", str(work),
            "--layers", "1", "--draft-vocab", "512", "--steps", "4", "--batch", "2", "--ckpt-every", "2",
            "--max-train-tokens", "1000"]
    assert distill_draft.main(argv) == 0
    report = json.loads((out / "distill_report.json").read_text())
    # Every part of the head's corpus, held-out splits included, and code capped as asked.
    assert {"top1_agreement_code", "top1_agreement_chat"} <= set(report["after_training"])
    code = distill_draft.data_windows(data, "code", "train", distill_draft.parse_args(argv))
    assert 1000 <= sum(map(len, code)) < 1000 + 65
    chat = torch.load(sorted((data / "chat" / "train").glob("chunk_*.pt"))[0])
    assert distill_draft.data_windows(data, "chat", "train", distill_draft.parse_args(argv))[0] == \
        chat["ids"][: int(chat["offsets"][1])].tolist()
    # Labels were saved in pieces: a rerun reuses them (and the finished parts) and resumes.
    assert list((work / "part_chat_train_top32.pieces").glob("*.pt"))
    # Labels came from the states stage's H (lm_head only), equal to a full target pass's.
    states = distill_draft.covering_states(data, "chat", "train", chat_windows := distill_draft.data_windows(
        data, "chat", "train", distill_draft.parse_args(argv)))
    assert states is not None
    target = load_llama(tiny_dirs["target"], torch.bfloat16)
    by_states = distill_draft.target_labels(target, chat_windows[1:3], 32, "states", states, first=1)
    by_pass = distill_draft.target_labels(target, chat_windows[1:3], 32, "target pass")
    for a, b in zip(by_states, by_pass):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # Windows the states do not hold (here: one token changed) are labelled by a target pass.
    changed = [list(w) for w in chat_windows]
    changed[-1][-1] = (changed[-1][-1] + 1) % target.cfg.vocab_size
    assert distill_draft.covering_states(data, "chat", "train", changed) is None
    greedy_equals_plain(tiny_dirs, SpecConfig(method="draft", num_spec_tokens=3, draft_model=str(out)))
    # --init-draft continues from the exported draft: with a zero learning rate, the second
    # export is the first one bit for bit (every layer and the vocabulary were loaded).
    again = tmp_path / "again"
    argv_again = [*argv, "--init-draft", str(out), "--lr", "0", "--steps", "1"]
    argv_again[argv_again.index("--out") + 1], argv_again[argv_again.index("--workdir") + 1] = str(again), str(work / "again")
    assert distill_draft.main(argv_again) == 0
    first, second = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((again / "distill_report.json").read_text())["init"] == f"draft {out}"
    with pytest.raises(SystemExit, match="num_hidden_layers=1, this run: 2"):
        distill_draft.main([*argv_again, "--layers", "2"])
    with pytest.raises(SystemExit, match="scores 512 tokens, this run asks for 256"):
        distill_draft.main([*argv_again, "--draft-vocab", "256"])


def test_generated_windows_outlive_the_machine_in_the_pack(tiny_dirs, tmp_path, monkeypatch):
    pack = tmp_path / "pack"
    first, second = tmp_path / "first", tmp_path / "second"
    corpus = ["--model", str(tiny_dirs["target"]), "--stage", "corpus", "--parts", "chat", "--pack", str(pack), *SMALL]
    assert head_data.main([*corpus, "--out", str(first)]) == 0
    stored = sorted(pack.glob("chat/*/chunk_*.npz"))
    assert len(stored) == len(sorted(first.glob("chat/*/chunk_*.pt"))) > 1
    # A new machine: every chunk comes back from the pack, the engine is never started.
    stored[-1].unlink()  # ...but for one, which the new machine generates (and adds to the pack)
    started = []
    make_engine = head_data.make_engine
    monkeypatch.setattr(head_data, "make_engine", lambda *a: started.append(1) or make_engine(*a))
    assert head_data.main([*corpus, "--out", str(second)]) == 0
    assert started == [1] and stored[-1].exists()
    for path in sorted(first.glob("chat/*/chunk_*.pt")):
        a, b = torch.load(path), torch.load(second / path.relative_to(first))
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["offsets"], b["offsets"])
    # A chunk made from other requests than its place now asks for (an edited instruction list): refused.
    args = head_data.parse_args([*corpus, "--out", str(tmp_path / "x")])
    requests = head_data.requests_for("chat", "train", args)  # chunk 0 holds requests[0:4] (--chunk 4)
    assert head_data.CorpusPack(pack, args).restore("chat", "train", 0, tmp_path / "ok.pt", requests[0:4])
    with pytest.raises(SystemExit, match="other requests"):
        head_data.CorpusPack(pack, args).restore("chat", "train", 0, tmp_path / "moved.pt", requests[1:5])
    # Other generation settings would mix two corpora: refused, saying which.
    with pytest.raises(SystemExit, match="chat_tokens"):
        head_data.main([*corpus, "--out", str(tmp_path / "third"), "--chat-tokens", "12"])
