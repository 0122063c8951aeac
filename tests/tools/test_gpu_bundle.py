"""tools/gpu_bundle.py and `tools/gpu_check.py --bundle` on the CPU: a bundle staged from this
environment (no download) stays under the size limit, holds what the check imports and not
the shipped GGUF, trims flashinfer to the kernels we use, and the check installs from it
into a temporary path, imports from there, and stops cleanly with "no CUDA device"."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_bundle  # noqa: E402


def fake_flashinfer_wheel(path: Path) -> Path:
    """The layout of a flashinfer-python wheel, tiny: files to keep and files to drop."""
    wheel = path / "flashinfer_python-0.7.4-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("flashinfer/__init__.py", "__version__ = '0.7.4'\n")
        zf.writestr("flashinfer/decode.py", "")
        zf.writestr("flashinfer/jit/core.py", "")
        zf.writestr("flashinfer/data/include/flashinfer/attention/decode.cuh", "")
        zf.writestr("flashinfer/data/csrc/batch_decode.cu", "")
        zf.writestr("flashinfer/data/csrc/batch_prefill_jit_binding.cu", "")
        zf.writestr("flashinfer/data/csrc/fused_moe_kernel.cu", "x" * 100_000)
        zf.writestr("flashinfer/data/include/flashinfer/gemm/huge.cuh", "x" * 100_000)
        zf.writestr("flashinfer/data/3rdparty/cutlass/include/cute.hpp", "x" * 100_000)
    return wheel


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bundle")
    out = tmp / "gpu_bundle"
    manifest = gpu_bundle.build(out, from_env=True, flashinfer=str(fake_flashinfer_wheel(tmp)))
    return out, manifest


def test_bundle_size_and_contents(bundle):
    out, manifest = bundle
    files = {str(f.relative_to(out)) for f in out.rglob("*") if f.is_file()}
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert total < gpu_bundle.LIMIT_BYTES and manifest["total_bytes"] <= total
    for module in ("msgspec", "zmq", "gguf", "websockets", "safetensors", "yaml"):
        assert any(f.startswith(f"site/{module}/") for f in files), module
    for needed in ("project/overlap/executor.py", "project/runtime/engine.py", "project/tools/gpu_check.py",
                   "project/tests/attention_oracle.py", "project/overlap/assets/smollm2-135m-draft/model.safetensors",
                   "project/overlap/assets/smollm2-135m-mtp/model.safetensors", "manifest.json",
                   "flashinfer/flashinfer/__init__.py", "flashinfer/flashinfer/data/csrc/batch_decode.cu",
                   "flashinfer/flashinfer/data/include/flashinfer/attention/decode.cuh"):
        assert needed in files, needed
    assert not any(f.endswith(".gguf") or "__pycache__" in f for f in files)
    assert not any("fused_moe" in f or "/gemm/" in f or "3rdparty" in f for f in files)
    assert json.loads((out / "manifest.json").read_text())["flashinfer"] == "flashinfer_python-0.7.4-py3-none-any.whl"


def test_gpu_check_installs_from_the_bundle_and_stops_without_cuda(bundle, tmp_path):
    out, _ = bundle
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(out / "project" / "tools" / "gpu_check.py"), "--bundle", str(out),
                           "--report", str(report)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "imports OK" in proc.stdout and "no CUDA device" in proc.stdout
    result = json.loads(report.read_text())
    assert result["status"] == "no CUDA device"
    modules = result["bundle"]["modules"]
    assert all(str(out) in (path or "") for path in modules.values()), modules  # imported from the bundle
