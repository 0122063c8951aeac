"""`overlap bench` / `generate` with speculative decoding, on the tiny random models: every
mode gives the same greedy tokens, and the report carries speedups and acceptance metrics."""

import json

import pytest

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from runtime import cli
from runtime.bench import Prompt, format_report, run_bench, write_report
from runtime.engine import Engine

PROMPTS = [Prompt("def add(a, b):\n    return a + b\n\ndef add(a, b):", "code"),
           Prompt("The cat sat on the mat. The cat sat on the", "chat"),
           Prompt("Hello, how are you?", "chat")]


def tiny_config(tiny_dirs, method="none") -> EngineConfig:
    return EngineConfig(model=str(tiny_dirs["target"]), dtype="float32",
                        cache=CacheConfig(page_size=16, num_pages=256),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_batched_tokens=256),
                        spec=SpecConfig(controller="off", method=method, num_spec_tokens=3,
                                        draft_model=str(tiny_dirs["draft"]) if method == "draft" else None))


@pytest.fixture(scope="module")
def report(tiny_dirs):
    variants = [(m, tiny_config(tiny_dirs, m)) for m in ("none", "draft", "ngram")]
    return run_bench(variants, PROMPTS, max_tokens=12, concurrencies=[1, 2], progress=False,
                     make_engine=lambda c: Engine(c, progress=False))


def test_modes_give_identical_outputs(report):
    base = {r["concurrency"]: [o["token_ids"] for o in r["outputs"]] for r in report["variants"][0]["runs"]}
    assert all(map(len, base[1])) and base[1] == base[2]
    for v in report["variants"]:
        for r in v["runs"]:
            assert [o["token_ids"] for o in r["outputs"]] == base[r["concurrency"]], (v["label"], r["concurrency"])
            if v["label"] == "none":
                assert r["vs_baseline"] is None
            else:
                assert (r["vs_baseline"]["identical"], r["vs_baseline"]["compared"]) == (3, 3)


def test_acceptance_metrics(report):
    base = {r["concurrency"]: r for r in report["variants"][0]["runs"]}
    for v in report["variants"]:
        for r in v["runs"]:
            # speedup is this run's tokens/s over the first variant's at the same concurrency
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base[r["concurrency"]]["tokens_per_s"])
            assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
            if v["label"] == "none":
                assert r["acceptance_length"] is None and r["drafts"] == 0
                assert r["acceptance_per_position"] == []
                continue
            assert r["drafts"] > 0 and r["draft_tokens"] >= r["drafts"]
            assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
            assert r["acceptance_length"] == pytest.approx(1 + r["accepted_tokens"] / r["drafts"])
            assert 1 <= r["acceptance_length"] <= 1 + 3
            assert 1 <= len(r["acceptance_per_position"]) <= 3
            assert all(0 <= x <= 1 for x in r["acceptance_per_position"])
            assert set(r["by_kind"]) == {"code", "chat"}
            assert r["by_kind"]["chat"]["requests"] == 2
    baseline = report["variants"][0]["runs"]
    assert all(r["speedup"] == 1.0 for r in baseline)


def test_report_table_and_json(report, tmp_path):
    table = format_report(report)
    assert "acc len" in table and "acc/pos" in table and "identical" in table
    assert "3/3" in table and "by prompt kind" in table and "code (n=1)" in table
    out = tmp_path / "report.json"
    write_report(report, out)
    data = json.loads(out.read_text())
    assert data["config"]["prompt_kinds"] == ["code", "chat", "chat"]
    assert [v["label"] for v in data["variants"]] == ["none", "draft", "ngram"]
    for v in data["variants"]:
        for r in v["runs"]:
            assert len(r["outputs"]) == 3 and all(o["token_ids"] for o in r["outputs"])
            assert [o["kind"] for o in r["outputs"]] == ["code", "chat", "chat"]


# -- the command line ----------------------------------------------------------------------


@pytest.fixture
def cached_engines(monkeypatch):
    cache = {}
    monkeypatch.setattr(cli, "make_engine",
                        lambda c: cache[c] if c in cache else cache.setdefault(c, Engine(c, progress=False)))
    return cache


def generate_json(capsys, *args):
    assert cli.main(["generate", *args, "--max-tokens", "10", "--json", "--dtype", "float32"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_spec_matches_plain(tiny_dirs, cached_engines, capsys):
    prompt, model = "a b c a b c a b", str(tiny_dirs["target"])
    plain = generate_json(capsys, prompt, "--model", model, "--spec", "none")
    assert "acceptance_length" not in plain["stats"]
    for extra in (["--spec", "ngram"], ["--spec", "draft", "--draft-model", str(tiny_dirs["draft"])]):
        # Controller off: every step verifies its 3 drafts. On, whether drafts pay on this tiny
        # model depends on the machine's timings (on an AMD EPYC it chose none at all).
        out = generate_json(capsys, prompt, "--model", model, "--num-spec-tokens", "3",
                            "--speculation-controller", "off", *extra)
        assert out["token_ids"] == plain["token_ids"], extra
        assert out["stats"]["acceptance_length"] >= 1
    assert {c.spec.num_spec_tokens for c in cached_engines if c.spec.method != "none"} == {3}


@pytest.mark.parametrize("interleave", ["rounds", "prompts"])
def test_bench_cli_orders_none_first(tiny_dirs, cached_engines, tmp_path, capsys, interleave):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.text, "kind": p.kind}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    assert cli.main(["bench", "--prompts", str(prompts), "--max-tokens", "6", "--model", str(tiny_dirs["target"]),
                     "--spec", "ngram", "none", "--dtype", "float32", "--json", str(out),
                     "--interleave", interleave]) == 0
    table = capsys.readouterr().out
    assert "identical" in table
    report = json.loads(out.read_text())
    assert report["config"]["interleave"] == interleave
    assert [v["label"] for v in report["variants"]] == ["none", "ngram"]
    assert report["variants"][1]["runs"][0]["vs_baseline"]["identical"] == 3


def test_rounds_interleave_the_modes_and_pair_their_ratios(tiny_dirs, monkeypatch, tmp_path):
    """--rounds: every mode loaded at once, each (mode, concurrency) run once per round with
    the modes back to back and the first mode rotating; speedups paired round by round."""
    from runtime import bench

    calls, real = [], bench.bench_once

    hit_rates = {}

    def recording(client, prompt_ids, max_tokens, c, label, *a, **kw):
        calls.append((label.split()[0], c))
        run = real(client, prompt_ids, max_tokens, c, label, *a, **kw)
        hit_rates.setdefault(calls[-1], []).append(run["prefix_cache"]["hit_rate"])
        return run

    monkeypatch.setattr(bench, "bench_once", recording)
    variants = [(m, tiny_config(tiny_dirs, m)) for m in ("none", "ngram")]
    # Prompts of several full KV pages each, so the prefix cache sees them.
    prompts = [Prompt(p.text * 4, p.kind) for p in PROMPTS]
    report = run_bench(variants, prompts, max_tokens=6, concurrencies=[1, 2], progress=False,
                       make_engine=lambda c: Engine(c, progress=False), rounds=3)
    assert calls == [("none", 1), ("ngram", 1), ("none", 2), ("ngram", 2),
                     ("ngram", 1), ("none", 1), ("ngram", 2), ("none", 2),
                     ("none", 1), ("ngram", 1), ("none", 2), ("ngram", 2)]
    assert report["config"]["rounds"] == 3
    base = {r["concurrency"]: r for r in report["variants"][0]["runs"]}
    for r in report["variants"][1]["runs"]:
        per_round = r["rounds_tokens_per_s"]
        assert len(per_round) == 3 and r["tokens_per_s"] == sorted(per_round)[1]  # the median round
        ratios = [a / b for a, b in zip(per_round, base[r["concurrency"]]["rounds_tokens_per_s"])]
        assert r["speedup_rounds"] == pytest.approx(ratios)
        assert r["speedup"] == pytest.approx(sorted(ratios)[1])
        assert r["vs_baseline"]["identical"] == 3
    # Primed before round 1: every round finds the same prompts' pages in the prefix cache (so
    # the row a variant shows, its median round, has the TTFT of the same cache state).
    assert all(len(set(rates)) == 1 and rates[0] > 0 for rates in hit_rates.values()), hit_rates
    table = format_report(report)
    assert f"({min(ratios):.2f}-{max(ratios):.2f})" in table
    from runtime.bench_plot import plot_report

    plot_report(report, tmp_path / "rounds.png")  # each round's spread drawn as bars
    assert (tmp_path / "rounds.png").stat().st_size > 0
    with pytest.raises(ValueError, match="rounds"):
        run_bench(variants, PROMPTS, max_tokens=6, concurrencies=[1], progress=False, rounds=0)


def test_interleave_prompts_pairs_the_modes_prompt_by_prompt(tiny_dirs, monkeypatch):
    """--interleave prompts: at c=1 each prompt runs on every mode back to back, the first
    mode rotating by prompt and round; a mode's wall time is the sum of its prompts' and its
    counters cover all of them; c=2 keeps the round's order."""
    from runtime import bench

    calls, walls, real = [], {}, bench.drive

    def recording(client, prompts, params, concurrency, **kw):
        traces, wall = real(client, prompts, params, concurrency, **kw)
        label = labels[id(client)]
        calls.append((label, len(prompts), concurrency))
        walls.setdefault((label, concurrency), []).append(wall)
        return traces, wall

    labels = {}
    real_open = bench.EngineClient.__init__

    def naming(self, engine):
        real_open(self, engine)
        labels[id(self)] = engine.config.spec.method

    monkeypatch.setattr(bench, "drive", recording)
    monkeypatch.setattr(bench.EngineClient, "__init__", naming)
    variants = [(m, tiny_config(tiny_dirs, m)) for m in ("none", "ngram")]
    prompts = [Prompt(p.text * 4, p.kind) for p in PROMPTS]
    report = run_bench(variants, prompts, max_tokens=6, concurrencies=[1, 2], progress=False,
                       make_engine=lambda c: Engine(c, progress=False), rounds=2, interleave="prompts")
    one = lambda *modes: [(m, 1, 1) for m in modes]  # noqa: E731
    assert calls == (one("none", "ngram", "ngram", "none", "none", "ngram") + [("none", 3, 2), ("ngram", 3, 2)]
                     + one("ngram", "none", "none", "ngram", "ngram", "none") + [("ngram", 3, 2), ("none", 3, 2)])
    assert report["config"]["interleave"] == "prompts"
    prompt_tokens = sum(report["config"]["prompt_tokens"])
    for v in report["variants"]:
        run = next(r for r in v["runs"] if r["concurrency"] == 1)
        per_round = [sum(walls[v["label"], 1][r * 3:(r + 1) * 3]) for r in range(2)]
        assert sorted(run["output_tokens"] / w for w in per_round) == pytest.approx(
            sorted(run["rounds_tokens_per_s"]))
        assert run["requests"] == 3 and run["prefix_cache"]["queried_tokens"] == prompt_tokens
    assert report["variants"][1]["runs"][0]["vs_baseline"]["identical"] == 3
    with pytest.raises(ValueError, match="interleave"):
        run_bench(variants, PROMPTS, max_tokens=6, concurrencies=[1], progress=False, interleave="steps")
