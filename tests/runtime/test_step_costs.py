"""`overlap bench --step-costs`: the step-cost curve the speculation controller plans with."""

import json
import subprocess
import sys

import pytest

from overlap.kernels import VARIANTS, kernels_name


@pytest.mark.slow
def test_step_costs_report_json_and_plot(tmp_path, smol_dir):
    out, png = tmp_path / "costs.json", tmp_path / "costs.png"
    proc = subprocess.run([sys.executable, "-m", "runtime", "bench", "--step-costs", "--context", "32",
                           "--json", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for batch in ("1", "8"):
        rows = report["target"][batch]
        assert list(rows) == ["1", "2", "4", "5", "8", "9", "16"]
        assert all(ms > 0 for ms in rows.values())
        assert report["ratio"][batch]["1"] == 1.0
        assert report["head"][batch] > 0 and report["draft"][batch] > 0
        assert report["head_fraction"][batch] == report["head"][batch] / rows["1"]
    # The build that ran: its variant, then its arithmetic and prefetch where they are chosen.
    assert report["machine"]["kernels"] == kernels_name()
    variant = report["machine"]["kernels"].split("-")[0]
    assert variant in [name for name, _, _ in VARIANTS.values()]
    # The drafters as the engine runs them: int8 by default on every SIMD build.
    weights = "bf16" if variant == "generic" else "int8"
    assert report["drafter_weights"] == weights
    assert "batch 1" in proc.stdout and f"head step ({weights} weights)" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibration_times_every_point_on_a_worker_thread(tiny_dirs):
    """The engine runs its forwards on a stream's worker thread; the curve is measured in the
    same threading."""
    import threading

    import torch

    from overlap.config import EngineConfig
    from overlap.models.llama import load_llama
    from runtime import step_costs

    model = load_llama(tiny_dirs["target"], torch.bfloat16)
    threads = set()
    forward = model.forward

    def recording_forward(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return forward(*args, **kwargs)

    model.forward = recording_forward
    points = step_costs.calibrate(model, EngineConfig(), context=16, rounds=2)
    assert list(points) == list(step_costs.CALIBRATION_ROWS)
    assert all(ms > 0 for ms in points.values())
    assert threads and threading.main_thread().name not in threads, threads


def test_spread_shares_rows_as_evenly_as_they_go():
    from runtime.step_costs import spread

    assert spread(9, 8) == [2, 1, 1, 1, 1, 1, 1, 1]
    assert spread(64, 8) == [8] * 8
    assert spread(3, 3) == [1, 1, 1]
    for total in range(1, 70):
        rows = spread(total, min(total, 8))
        assert sum(rows) == total and max(rows) - min(rows) <= 1


def test_a_kernel_change_measures_the_curve_again(monkeypatch, tmp_path):
    """The cached curve belongs to one kernel build: after a kernel change the controller does
    not plan with the old build's costs (here, with no model at hand, it falls back to the
    documented default instead of reading the stale cache)."""
    from types import SimpleNamespace

    import overlap.kernels
    from overlap.config import EngineConfig
    from runtime import step_costs

    monkeypatch.setenv("HOME", str(tmp_path))
    arch = SimpleNamespace(hidden_size=64, num_layers=2, vocab_size=256, intermediate_size=128,
                           num_heads=4, num_kv_heads=2)
    config = EngineConfig()
    cached = step_costs._cache_path(config, arch)
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({"points": {"1": 10.0, "4": 99.0}}))

    assert step_costs.controller_cost_model(config, model_cfg=arch).ms == [10.0, 99.0]
    monkeypatch.setattr(overlap.kernels, "_sources_digest", lambda: "another-build")
    assert step_costs._cache_path(config, arch) != cached
    model = step_costs.controller_cost_model(config, model_cfg=arch)
    assert model.rows == sorted(step_costs.DEFAULT_CURVE)


def test_a_heads_own_draft_vocabulary_is_part_of_the_cache_key(tmp_path):
    """A run naming no --draft-vocab drafts with the head's config.json size: when the shipped
    head's size changed (8,192 -> 4,096), a curve cached with the old size's head step must
    not be reused."""
    from overlap.config import SpecConfig
    from runtime.step_costs import _drafter_key

    (tmp_path / "config.json").write_text(json.dumps({"draft_vocab": 8192}))
    spec = SpecConfig(method="eagle", head=str(tmp_path))
    before = _drafter_key(spec)
    (tmp_path / "config.json").write_text(json.dumps({"draft_vocab": 4096}))
    assert _drafter_key(spec) != before and 4096 in _drafter_key(spec)
    assert 2048 in _drafter_key(SpecConfig(method="eagle", head=str(tmp_path), draft_vocab=2048))
