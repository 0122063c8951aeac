"""The engine options every engine-building command shares (generate, bench, serve):
--device / --attention-backend reach the EngineConfig, and --num-spec-tokens is an error
with --spec eagle instead of being ignored. No model loads here."""

from pathlib import Path

import pytest
import torch

from runtime import cli

COMMANDS = [["generate", "x"], ["bench", "--prompts", "p.jsonl"], ["serve"]]


def config_of(*argv: str, method: str | None = None):
    args = cli.build_parser().parse_args(list(argv))
    return cli.engine_config(args, method if method is not None else getattr(args, "spec", None))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_device_and_backend_reach_the_config(command):
    config = config_of(*command, "--device", "cpu", "--attention-backend", "reference")
    assert (config.device, config.attention_backend) == ("cpu", "reference")
    assert (config_of(*command).device, config_of(*command).attention_backend) == ("cpu", "auto")


@pytest.mark.parametrize("argv, needle", [
    (["--attention-backend", "flashinfer"], "needs a CUDA device"),
    (["--device", "tpu"], "cpu, cuda or cuda:N"),
])
def test_bad_device_is_one_line_before_loading(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(cli, "make_engine", lambda config: pytest.fail("an engine was built"))
    assert cli.main(["generate", "x", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("overlap: error: ") and needle in err and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_cuda_on_a_cpu_machine_fails_clearly(capsys, monkeypatch):
    monkeypatch.setattr(cli, "make_engine", lambda config: pytest.fail("an engine was built"))
    assert cli.main(["generate", "x", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_num_spec_tokens_with_eagle_is_an_error(command):
    with pytest.raises(ValueError, match="--num-spec-tokens does not apply to --spec eagle"):
        config_of(*command, "--num-spec-tokens", "3", method="eagle")
    assert config_of(*command, "--tree-depth", "2", method="eagle").spec.tree_depth == 2
    assert config_of(*command, "--num-spec-tokens", "3", method="mtp").spec.num_spec_tokens == 3


def test_bench_eagle_with_num_spec_tokens_names_the_fix(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    assert cli.main(["bench", "--prompts", str(prompts), "--spec", "none", "eagle", "--num-spec-tokens", "3"]) == 2
    assert "(mtp:3)" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_drafter_weights_reach_the_config_and_need_a_drafter(command):
    assert config_of(*command, "--drafter-weights", "int8", method="mtp").spec.drafter_weights == "int8"
    assert config_of(*command, method="draft").spec.drafter_weights == "auto"
    if command[0] != "bench":  # bench gives the option to its drafting modes only (below)
        with pytest.raises(ValueError, match="--spec ngram has no drafter weights"):
            config_of(*command, "--drafter-weights", "int8", method="ngram")


def test_bench_runs_each_drafting_mode_with_each_drafter_weights():
    args = cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--spec", "none", "ngram", "mtp:3",
                                          "--drafter-weights", "bf16", "int8"])
    variants = cli._bench_variants(args)
    assert [(v.label, v.config.spec.drafter_weights) for v in variants] == [
        ("none", "auto"), ("ngram", "auto"), ("mtp:3 bf16", "bf16"), ("mtp:3 int8", "int8")]
    args = cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--spec", "none", "draft",
                                          "--drafter-weights", "int8"])
    assert [(v.label, v.config.spec.drafter_weights) for v in cli._bench_variants(args)] == [
        ("none", "auto"), ("draft", "int8")]


def test_bench_runs_each_head_mode_with_each_draft_vocabulary():
    """--draft-vocab N M in bench: mtp and eagle run with each size, side by side in one run;
    the other modes (draft carries its own vocabulary) run once, at their default."""
    args = cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--spec", "none", "draft:3", "eagle",
                                          "--draft-vocab", "8192", "4096"])
    assert [(v.label, v.config.spec.draft_vocab) for v in cli._bench_variants(args)] == [
        ("none", None), ("draft:3", None), ("eagle vocab=8192", 8192), ("eagle vocab=4096", 4096)]
    one = cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--spec", "mtp", "--draft-vocab", "2048"])
    assert [(v.label, v.config.spec.draft_vocab) for v in cli._bench_variants(one)] == [("mtp", 2048)]
    assert config_of("generate", "x", "--draft-vocab", "4096", method="eagle").spec.draft_vocab == 4096
    with pytest.raises(ValueError, match="give a positive N, with --spec mtp or eagle"):
        config_of("generate", "x", "--draft-vocab", "4096", method="draft")
    with pytest.raises(ValueError, match="measures one draft vocabulary"):
        cli._bench_step_costs(cli.build_parser().parse_args(["bench", "--step-costs", "--draft-vocab", "1", "2"]))
    with pytest.raises(ValueError, match="none is benchmarked"):
        cli._bench_variants(cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--spec", "none", "draft",
                                                           "--draft-vocab", "4096"]))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--draft-vocab", "4096", "-1"])


def test_a_config_files_draft_vocabulary_stays_with_its_head_modes():
    """configs/smollm2-135m-mtp.toml names the head's vocabulary and a lookup branch; asked for
    another mode (the draft model, or a bench's none), they apply where they can and are not
    an error (a bench of that config with --spec none failed on both before)."""
    mtp = str(Path(cli.__file__).resolve().parent.parent / "configs" / "smollm2-135m-mtp.toml")
    assert config_of("generate", "x", "--config", mtp, method="mtp").spec.draft_vocab == 4096
    assert config_of("generate", "x", "--config", mtp, method="draft").spec.draft_vocab is None
    args = cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--config", mtp,
                                          "--spec", "none", "draft:3", "mtp:3"])
    assert [(v.label, v.config.spec.draft_vocab, v.config.spec.lookup_branch) for v in cli._bench_variants(args)] == [
        ("none", None, 0), ("draft:3 lookup=8", None, 8), ("mtp:3 lookup=8", 4096, 8)]
    with pytest.raises(ValueError, match="the branch is verified beside a model drafter"):  # asked for: an error
        config_of("generate", "x", "--lookup-branch", "4", method="ngram")
