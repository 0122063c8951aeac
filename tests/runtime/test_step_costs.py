"""`overlap bench --step-costs`: the step-cost curve the speculation controller plans with."""

import json
import subprocess
import sys

import pytest

from overlap.kernels import VARIANTS


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
    assert report["machine"]["kernels"] in [name for name, _, _ in VARIANTS.values()]
    assert "batch 1" in proc.stdout and "head step" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
