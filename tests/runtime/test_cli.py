"""The `overlap` command line: generate, bench, convert; errors are one line and exit 2.

The real shipped model runs here. Engines are cached per config for the whole session
(cli.make_engine is swapped for a cached one), so each model loads once.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlap.config import default_draft_dir, default_tree_tokens, load_config, tree_tokens
from runtime import bench, cli
from runtime.engine import Delta

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def add(a, b):\n    "]


@pytest.fixture(scope="session")
def engine_cache():
    return {}


@pytest.fixture(autouse=True)
def cached_engines(monkeypatch, engine_cache):
    real = cli.make_engine

    def make(config):
        if config not in engine_cache:
            engine_cache[config] = real(config)
        return engine_cache[config]

    monkeypatch.setattr(cli, "make_engine", make)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "kind": "test"}) + "\n" for p in PROMPTS))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "runtime", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(rc: int, err: str, needle: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("overlap: error: ") and needle in lines[0], lines[0]


# -- generate ------------------------------------------------------------------------------


def test_generate_streams_text(capsys):
    assert cli.main(["generate", "The capital of France is", "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "8 tokens" in err and "tok/s" in err and "finish: length" in err


@pytest.mark.slow  # a fresh interpreter loading the shipped model
def test_generate_subprocess():
    proc = run_cli("generate", "The capital of France is", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_generate_json(capsys):
    assert cli.main(["generate", "The capital of France is", "--max-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
    assert len(out["token_ids"]) == out["stats"]["output_tokens"] == 8
    assert out["finish_reason"] == "length" and "Paris" in out["text"]


def test_generate_chat_and_stop(capsys):
    assert cli.main(["generate", "What is the capital of France?", "--chat", "--max-tokens", "16",
                     "--json", "--stop", "Paris"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] in ("stop", "length")
    assert "Paris" not in out["text"]  # a stop string is cut from the output


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, needle", [
    (["generate", ""], "prompt: is empty"),
    (["generate", "x", "--max-tokens", "0"], "max_tokens"),
    (["generate", "x", "--max-tokens", "abc"], "--max-tokens"),
    (["generate", "x", "--temperature", "-1"], "temperature"),
    (["generate", "x", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf does not exist"),
    (["generate", "hello " * 5000], "context"),
    (["generate", "x", "--config", "/nonexistent/engine.toml"], "config file"),
    (["bench", "--prompts", "/nonexistent/prompts.jsonl"], "prompts file"),
    (["bench", "--prompts", "PROMPTS", "--max-tokens", "0"], "max_tokens"),
    (["bench", "--prompts", "PROMPTS", "--concurrency", "0"], "--concurrency"),
    (["convert", "/nonexistent/model.gguf"], "does not exist"),
    (["generate", "x", "--spec", "medusa"], "--spec"),
    (["bench", "--prompts", "PROMPTS", "--spec", "none", "bogus"], "--spec"),
    (["bench", "--prompts", "PROMPTS", "--spec", "eagle:0"], "K must be a positive integer"),
    (["generate", "x", "--num-spec-tokens", "0"], "--num-spec-tokens"),
    (["generate", "x", "--spec", "draft", "--model", "/nonexistent/model.gguf"],
     "--spec draft needs --draft-model for a non-default model"),
    (["bench", "--prompts", "PROMPTS", "--spec", "none", "draft", "--model", "/some/other/model"],
     "--spec draft needs --draft-model for a non-default model"),
    (["generate", "x", "--spec", "draft", "--draft-model", "/nonexistent/draft"], "/nonexistent/draft"),
    (["generate", "x", "--spec", "ngram", "--lookup-branch", "4"], "--lookup-branch 4: the branch is verified beside"),
    (["generate", "x", "--spec", "mtp", "--lookup-branch", "-1"], "--lookup-branch"),
    ([], "COMMAND"),
])
def test_bad_arguments_exit_2(argv, needle, prompts_file, capsys):
    argv = [str(prompts_file) if a == "PROMPTS" else a for a in argv]
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert_one_line_error(rc, err, needle)
    assert out == ""


@pytest.mark.parametrize("bad, needle", [
    ('not json\n', "line 2: not valid JSON"),
    ('{"text": "no prompt field"}\n', "line 2: expected an object"),
    ('["a list"]\n', "line 2: expected an object"),
])
def test_bad_prompts_file_exit_2(tmp_path, bad, needle, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + bad)
    rc = cli.main(["bench", "--prompts", str(path), "--max-tokens", "4"])
    assert_one_line_error(rc, capsys.readouterr().err, needle)


@pytest.mark.parametrize("argv", [["generate", "x", "--spec", "draft"],
                                  ["bench", "--prompts", "PROMPTS", "--spec", "none", "draft"],
                                  ["generate", "x", "--draft-model", "MISSING", "--spec", "draft"]])
def test_missing_shipped_draft_exit_2(argv, prompts_file, tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-draft"
    monkeypatch.setattr(cli, "default_draft_dir", lambda: missing)
    rc = cli.main([{"PROMPTS": str(prompts_file), "MISSING": str(missing)}.get(a, a) for a in argv])
    assert_one_line_error(rc, capsys.readouterr().err,
                          f"the shipped draft is missing at {missing}; train it with tools/distill_draft.py")


def test_bad_arguments_subprocess(tmp_path):
    proc = run_cli("generate", "x", "--max-tokens", "0")
    assert_one_line_error(proc.returncode, proc.stderr, "max_tokens")
    proc = run_cli("bench", "--prompts", str(tmp_path / "missing.jsonl"))
    assert_one_line_error(proc.returncode, proc.stderr, "missing.jsonl does not exist")


# -- bench ---------------------------------------------------------------------------------


def test_bench_writes_json_and_is_batch_invariant(prompts_file, tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = cli.main(["bench", "--prompts", str(prompts_file), "--max-tokens", "8",
                   "--concurrency", "1", "2", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "tok/s" in table and "bandwidth efficiency" in table
    report = json.loads(out.read_text())
    assert report["config"]["concurrency"] == [1, 2] and report["hf"] is None
    assert report["bandwidth"]["copy_bytes_per_s"] > 0
    (variant,) = report["variants"]
    assert variant["floor_ms_per_token"] == pytest.approx(
        variant["weight_bytes"] / report["bandwidth"]["copy_bytes_per_s"] * 1e3)
    assert variant["bandwidth_efficiency"] == pytest.approx(variant["floor_ms_per_token"] / variant["ms_per_token"])
    runs = {r["concurrency"]: r for r in variant["runs"]}
    assert set(runs) == {1, 2}
    for r in runs.values():
        assert r["requests"] == 2 and r["output_tokens"] == sum(len(o["token_ids"]) for o in r["outputs"])
        assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["requests_per_s"] == pytest.approx(r["requests"] / r["wall_s"])
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] <= r["wall_s"] * 1e3
        assert 0 <= r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["wall_s"] * 1e3
    ids = {c: [o["token_ids"] for o in r["outputs"]] for c, r in runs.items()}
    assert all(ids[1]) and ids[1] == ids[2]  # greedy outputs do not depend on the batch


@pytest.mark.slow  # the shipped model through transformers too
def test_bench_compare_hf_float32(prompts_file, tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = cli.main(["bench", "--prompts", str(prompts_file), "--max-tokens", "16", "--concurrency", "1",
                   "--compare-hf", "--dtype", "float32", "--json", str(out)])
    assert rc == 0
    assert "HF transformers" in capsys.readouterr().out
    hf = json.loads(out.read_text())["hf"]
    ours = json.loads(out.read_text())["variants"][0]["runs"][0]
    assert hf["dtype"] == "float32" and hf["speed_ratio"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"])
    assert (hf["identical"], hf["compared"]) == (2, 2)
    assert hf["common_prefix"] == [len(ids) for ids in hf["token_ids"]]


# -- configs -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in a config are relative to the file, not the cwd
    config = load_config(path)
    assert config.spec.method in cli.SPEC_METHODS and config.model is None
    if config.spec.method == "draft":
        assert config.spec.draft_model == str(default_draft_dir().resolve())
    if config.spec.method in ("mtp", "eagle"):
        from overlap.config import default_head_dir

        assert config.spec.head == str(default_head_dir().resolve())


def test_bench_spec_variants_none_first(prompts_file, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda variants, *a, **kw: seen.extend(variants) or {})
    monkeypatch.setattr(bench, "format_report", lambda report: "")
    assert cli.main(["bench", "--prompts", str(prompts_file), "--spec", "ngram", "none", "ngram",
                     "--num-spec-tokens", "2", "--page-size", "8"]) == 0
    assert [v.label for v in seen] == ["none", "ngram"]
    assert [v.config.spec.method for v in seen] == ["none", "ngram"]
    assert all(v.config.spec.num_spec_tokens == 2 and v.config.cache.page_size == 8 for v in seen)
    assert all(v.server is None and v.config.overlap for v in seen)


def test_bench_no_overlap_adds_a_variant_per_mode(prompts_file, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda variants, *a, **kw: seen.extend(variants) or {})
    monkeypatch.setattr(bench, "format_report", lambda report: "")
    assert cli.main(["bench", "--prompts", str(prompts_file), "--spec", "none", "ngram", "--no-overlap"]) == 0
    assert [(v.label, v.config.overlap) for v in seen] == [
        ("none", True), ("none no-overlap", False), ("ngram", True), ("ngram no-overlap", False)]


def test_bench_aa_adds_a_second_identical_none_engine(prompts_file, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda variants, *a, **kw: seen.extend(variants) or {})
    monkeypatch.setattr(bench, "format_report", lambda report: "")
    assert cli.main(["bench", "--prompts", str(prompts_file), "--spec", "ngram", "none", "--aa"]) == 0
    assert [v.label for v in seen] == ["none", "none A/A", "ngram"]
    assert seen[1].config == seen[0].config and seen[1].server is None


def test_bench_runs_each_speculative_mode_with_the_controller_on_and_off(prompts_file, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda variants, *a, **kw: seen.extend(variants) or {})
    monkeypatch.setattr(bench, "format_report", lambda report: "")
    curve = tmp_path / "costs.json"
    assert cli.main(["bench", "--prompts", str(prompts_file), "--spec", "none", "ngram",
                     "--speculation-controller", "on", "off", "--cost-curve", str(curve)]) == 0
    assert [(v.label, v.config.spec.controller) for v in seen] == [
        ("none", "on"), ("ngram controller=on", "on"), ("ngram controller=off", "off")]
    assert all(v.config.spec.step_costs == str(curve) for v in seen)


def test_bench_runs_each_model_drafter_mode_with_each_lookup_branch(prompts_file, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda variants, *a, **kw: seen.extend(variants) or {})
    monkeypatch.setattr(bench, "format_report", lambda report: "")
    assert cli.main(["bench", "--prompts", str(prompts_file), "--spec", "none", "ngram", "mtp:3", "draft",
                     "--lookup-branch", "0", "4"]) == 0
    # Only the model drafters take a branch: none and ngram run once, without one.
    assert [(v.label, v.config.spec.lookup_branch) for v in seen] == [
        ("none", 0), ("ngram", 0), ("mtp:3", 0), ("mtp:3 lookup=4", 4), ("draft", 0), ("draft lookup=4", 4)]


def test_bench_eagle_n_runs_a_tree_of_n_nodes(prompts_file, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda variants, *a, **kw: seen.extend(variants) or {})
    monkeypatch.setattr(bench, "format_report", lambda report: "")
    assert cli.main(["bench", "--prompts", str(prompts_file), "--spec", "eagle:5", "eagle:8", "eagle"]) == 0
    assert [(v.label, v.config.spec.tree_tokens) for v in seen] == [("eagle:5", 5), ("eagle:8", 8), ("eagle", None)]
    assert tree_tokens(seen[2].config) == default_tree_tokens("cpu")


def test_generate_takes_the_controller_switch():
    args = cli.build_parser().parse_args(["generate", "x", "--spec", "ngram", "--speculation-controller", "off"])
    assert cli.engine_config(args, args.spec).spec.controller == "off"


def test_compare_inprocess_needs_server(prompts_file, capsys):
    assert cli.main(["bench", "--prompts", str(prompts_file), "--compare-inprocess"]) == 2
    assert "--compare-inprocess needs --server" in capsys.readouterr().err


def test_generate_without_a_server_fails_clearly(capsys):
    # Nothing listens on this port: the client times out and says what to check.
    assert cli.main(["generate", "hi", "--server", "tcp://127.0.0.1:9", "--timeout", "1"]) == 2
    assert "is `overlap serve` running there?" in capsys.readouterr().err


# -- bench internals (no model) ------------------------------------------------------------


class FakeClient:
    """Each step gives every in-flight request one delta of `per_step` tokens."""

    def __init__(self, lengths, per_step=1):
        self.lengths, self.per_step = lengths, per_step
        self.live: dict[str, list] = {}
        self.max_in_flight = 0

    def add(self, prompt_ids, params):
        rid = f"r{len(self.live)}-{prompt_ids[0]}"
        self.live[rid] = [self.lengths[prompt_ids[0]], 0]
        self.max_in_flight = max(self.max_in_flight, sum(1 for n, done in self.live.values() if done < n))
        return rid

    def step(self):
        deltas = []
        for rid, state in self.live.items():
            n, done = state
            if done < n:
                k = min(self.per_step, n - done)
                state[1] += k
                deltas.append(Delta(rid, "", list(range(done, done + k)), "length" if done + k == n else None))
        return deltas


def test_drive_keeps_concurrency_in_flight():
    client = FakeClient(lengths=[3, 5, 2, 4, 1])
    traces, wall = bench.drive(client, [[i] for i in range(5)], bench.SamplingParams(), concurrency=2)
    assert client.max_in_flight == 2
    assert [len(t.token_ids) for t in traces] == [3, 5, 2, 4, 1]
    assert all(t.finish_reason == "length" for t in traces)


def test_summarize_splits_multi_token_deltas():
    t = bench.Trace(submitted=0.0, token_ids=list(range(5)), arrivals=[(0.1, 1), (0.3, 4)])
    s = bench.summarize([t], wall_s=1.0)
    assert s["output_tokens"] == 5 and s["tokens_per_s"] == 5.0
    assert s["ttft_p50_ms"] == pytest.approx(100.0)
    assert s["itl_p50_ms"] == pytest.approx(50.0) and s["itl_mean_ms"] == pytest.approx(50.0)


def test_compare_outputs_truncates_to_shorter():
    r = bench.compare_outputs([[1, 2, 3], [1, 2], [1, 9, 3]], [[1, 2, 3, 4], [1, 2], [1, 2, 3]])
    assert r == {"identical": 2, "compared": 3, "common_prefix": [3, 2, 1]}


def test_weight_bytes_counts_tied_once():
    import torch

    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    m.b = m.a
    assert bench.weight_bytes(m) == 20


def test_bench_mode_with_its_own_k(prompts_file, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda variants, *a, **kw: seen.extend(variants) or {})
    monkeypatch.setattr(bench, "format_report", lambda report: "")
    assert cli.main(["bench", "--prompts", str(prompts_file), "--spec", "ngram:2", "none", "ngram:5"]) == 0
    assert [(v.label, v.config.spec.method, v.config.spec.num_spec_tokens) for v in seen] == [
        ("none", "none", 4), ("ngram:2", "ngram", 2), ("ngram:5", "ngram", 5)]
