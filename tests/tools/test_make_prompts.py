"""The benchmark prompt sets in benchmarks/prompts/ (tools/make_prompts.py): the line format
`overlap bench` reads, no code prompt from a training-split file of the drafters' corpus, chat
prompts in the model's chat template, and regeneration reproduces the files."""

import json
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "benchmarks" / "prompts"
sys.path.insert(0, str(REPO / "tools"))

import corpus  # noqa: E402
import make_prompts  # noqa: E402
from runtime.bench import load_prompts  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def lines(name: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPTS / name).read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def sources() -> dict:
    return json.loads((PROMPTS / "sources.json").read_text())


def test_format_is_what_bench_reads():
    for name, kind in (("code.jsonl", "code"), ("chat.jsonl", "chat")):
        rows = lines(name)
        assert len(rows) >= 100
        assert all(set(r) == {"prompt", "kind"} and r["kind"] == kind and r["prompt"] for r in rows)
        assert len({r["prompt"] for r in rows}) == len(rows)  # no duplicates
        assert [(p.text, p.kind) for p in load_prompts(PROMPTS / name)] == [(r["prompt"], kind) for r in rows]
    assert len(lines("code.jsonl")) + len(lines("chat.jsonl")) >= 250


def test_every_code_prompt_comes_from_a_held_out_file(sources):
    assert sources["held_out_every"] == corpus.HELD_OUT_EVERY
    assert len(sources["code"]) == len(lines("code.jsonl"))
    train, _ = corpus.split_files()
    training = {f.relative_to(STDLIB).as_posix() for f in train}
    for src in sources["code"]:
        # The split function the training tools use, on the path the prompt was cut from.
        assert corpus.is_held_out(STDLIB / src["file"]), src
        assert src["file"] not in training, src
        assert "pip" not in Path(src["file"]).parts and "site-packages" not in src["file"]


def test_no_code_prompt_is_text_of_a_training_file():
    """Stronger than the file split: the prompt's text occurs in no training-split file (a
    function copied between modules would otherwise leak through)."""
    train, _ = corpus.split_files()
    text = "\n".join(corpus.read_text(f) for f in train)
    heads = {line.strip() for line in text.splitlines()}
    for row in lines("code.jsonl"):
        prompt = row["prompt"]
        assert not (prompt.splitlines()[0].strip() in heads and prompt in text), prompt[:80]


def test_code_prompts_match_their_sources(sources):
    if sources["python"] != ".".join(map(str, sys.version_info[:3])):
        pytest.skip(f"prompts were cut from Python {sources['python']}'s stdlib")
    cut = {}
    for row, src in zip(lines("code.jsonl"), sources["code"]):
        if src["file"] not in cut:
            cut[src["file"]] = {line: prompt for line, prompt, _ in make_prompts.function_prompts(STDLIB / src["file"])}
        assert cut[src["file"]][src["line"]] == row["prompt"]


def test_chat_prompts_are_the_template_around_our_own_instructions():
    rows = lines("chat.jsonl")
    assert [r["prompt"] for r in rows] == make_prompts.chat_prompts()
    for training in (corpus.chat_instructions(), corpus.many_chat_instructions(), corpus.more_chat_instructions()):
        assert not set(make_prompts.CHAT_INSTRUCTIONS) & set(training)  # not the training ones
    for r in rows:
        assert r["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")  # where the answer starts
        assert r["prompt"].count("<|im_start|>user\n") == 1


@pytest.mark.slow
def test_regeneration_reproduces_the_files(sources, capsys):
    if sources["python"] != ".".join(map(str, sys.version_info[:3])):
        pytest.skip(f"prompts were cut from Python {sources['python']}'s stdlib")
    assert make_prompts.main(["--check"]) == 0, capsys.readouterr().out
