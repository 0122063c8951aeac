"""`overlap bench --shared-prefix N`: every prompt behind the same N tokens, each mode with the
prefix cache and without; the report carries hit rates and the TTFT pair, the plot a TTFT panel.
Tiny random model: the numbers mean nothing here, only that they are measured and reported."""

import json

from runtime import cli
from runtime.bench import shared_prefix_ids, ttft_with_and_without_cache
from runtime.engine import Engine

PROMPTS = ["def add(a, b):", "The cat sat on the", "Hello, how are you?"]


def test_bench_shared_prefix_compares_the_cache_on_and_off(tiny_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "make_engine", lambda c: Engine(c, progress=False))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    assert cli.main(["bench", "--prompts", str(prompts), "--max-tokens", "4", "--model", str(tiny_dirs["target"]),
                     "--spec", "none", "ngram", "--dtype", "float32", "--page-size", "16", "--shared-prefix", "100",
                     "--json", str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [v["label"] for v in report["variants"]] == ["none", "none no-prefix-cache", "ngram",
                                                         "ngram no-prefix-cache"]
    assert report["config"]["shared_prefix_tokens"] == 100
    assert all(n > 100 for n in report["config"]["prompt_tokens"])
    on, off = (report["variants"][i]["runs"][0] for i in (0, 1))
    # The warm-up request cached the shared prefix: every measured request hits its 6 full pages.
    assert on["prefix_cache"]["hit_tokens"] >= 3 * 96
    assert off["prefix_cache"] is None
    assert all(v["runs"][0]["vs_baseline"] is None or v["runs"][0]["vs_baseline"]["identical"] == 3
               for v in report["variants"])
    pairs = ttft_with_and_without_cache(report)
    assert [(p["mode"], p["concurrency"]) for p in pairs] == [("none", 1), ("ngram", 1)]
    assert "with the prefix cache" in table and "hit rate" in table
    assert png.stat().st_size > 0


def test_shared_prefix_ids_repeat_the_system_prompt_to_length():
    class Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    ids = shared_prefix_ids(Chars(), 3000)
    assert len(ids) == 3000 and ids[:34] == Chars().encode("You are a meticulous assistant for")
