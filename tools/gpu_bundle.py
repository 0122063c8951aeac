"""Stage what `tools/gpu_check.py --bundle DIR` needs on an air-gapped GPU machine that has a
CUDA torch and nothing else of ours: run this where packages can be reached, copy DIR over.

    python tools/gpu_bundle.py --out gpu_bundle            # wheels for Python 3.11 and 3.12
    python tools/gpu_bundle.py --out DIR --from-env        # this environment's installed copies
    python tools/gpu_bundle.py --out DIR --flashinfer-wheel flashinfer_python-0.7.4-py3-none-any.whl

DIR gets:
  wheels/      msgspec, pyzmq, gguf, websockets, safetensors, pyyaml (gguf's) as manylinux
               x86_64 wheels per Python version (`pip download`), or
  site/        with --from-env: those packages' installed files copied from this environment
               (same Python and platform as the GPU machine only);
  project/     overlap/ and runtime/ (the shipped draft and MTP head included: 22 MB) and
               tools/gpu_check.py, tests/attention_oracle.py;
  flashinfer/  the flashinfer package trimmed to what our kernels JIT-compile (FA2 decode and
               prefill over a paged KV cache, bf16/fp16, head_dim 64): its Python sources, the
               headers, and the csrc files of those modules. The wheel is ~100 MB of sources; the
               shipped GGUF (98 MB) stays out: the check runs the model's exact shapes on random
               weights (or real ones with --model DIR there);
  manifest.json  what was staged, sizes, versions.
The whole bundle must stay under LIMIT_BYTES (60 MB); the tool fails if it does not.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 60 * 1024 * 1024
PACKAGES = ["msgspec", "pyzmq", "gguf", "websockets", "safetensors", "pyyaml"]
FLASHINFER_VERSION = "0.7.4"  # the version overlap/attention/flashinfer.py was checked against
PYTHONS = ("3.11", "3.12")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64")
PROJECT = ["overlap", "runtime", "tools/gpu_check.py", "tests/attention_oracle.py", "pyproject.toml"]
SKIP = ["__pycache__", "*.pyc", "*.so", "*.egg-info"]
# flashinfer: what the kernels we run need (BatchDecode / BatchPrefill, FA2, paged KV). Python
# sources and headers stay whole (small); of csrc only the JIT modules of those wrappers and
# their shared helpers. Big trees for other kernel families (cutlass GEMMs, MoE, comm, trtllm,
# cubins) are left out.
FLASHINFER_KEEP = ["flashinfer/*.py", "flashinfer/jit/*", "flashinfer/*/*.py", "flashinfer/data/include/flashinfer/*",
                   "flashinfer/data/csrc/batch_decode*", "flashinfer/data/csrc/batch_prefill*",
                   "flashinfer/data/csrc/page*", "flashinfer/data/csrc/*utils*", "flashinfer/data/csrc/*.h",
                   "flashinfer/data/csrc/*config*", "flashinfer/data/csrc/*binding*", "flashinfer/data/csrc/*jit*",
                   "flashinfer/include/flashinfer/*", "flashinfer/csrc/batch_decode*", "flashinfer/csrc/batch_prefill*",
                   "flashinfer/csrc/page*", "flashinfer/csrc/*utils*", "flashinfer/csrc/*.h", "flashinfer/csrc/*config*",
                   "flashinfer/csrc/*binding*", "flashinfer/csrc/*jit*", "flashinfer_python-*.dist-info/*"]
FLASHINFER_DROP = ["*/include/flashinfer/gemm/*", "*/include/flashinfer/comm/*", "*/include/flashinfer/trtllm/*",
                   "*/include/flashinfer/mla*", "*/cubins/*", "*/3rdparty/*", "*/cutlass/*"]


def _skip(path: Path) -> bool:
    return any(fnmatch.fnmatch(part, pattern) for part in path.parts for pattern in SKIP)


def stage_project(out: Path) -> None:
    for name in PROJECT:
        src = ROOT / name
        dst = out / "project" / name
        if src.is_dir():
            for f in src.rglob("*"):
                if f.is_file() and not _skip(f.relative_to(ROOT)):
                    (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, dst / f.relative_to(src))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def stage_wheels(out: Path, pythons=PYTHONS) -> None:
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for py in pythons:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", py, "--implementation", "cp", "--dest", str(wheels)]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd + PACKAGES, check=True)


def stage_from_env(out: Path) -> None:
    """The installed files of PACKAGES (this Python and platform only), as an importable dir."""
    site = out / "site"
    for name in PACKAGES:
        dist = importlib.metadata.distribution(name)
        for f in dist.files or []:
            src, rel = Path(dist.locate_file(f)), Path(str(f))
            if not src.is_file() or ".." in rel.parts or "__pycache__" in rel.parts or rel.suffix == ".pyc":
                continue  # scripts installed outside site-packages, bytecode
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, site / rel)


def stage_flashinfer(out: Path, wheel: Path | None) -> str | None:
    """flashinfer's trimmed sources into out/flashinfer (importable: that dir goes on sys.path)."""
    if wheel is None:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            f"flashinfer-python=={FLASHINFER_VERSION}", "--dest", tmp], check=True)
            found = sorted(Path(tmp).glob("flashinfer_python-*"))
            if not found:
                raise SystemExit("pip download gave no flashinfer-python file")
            return stage_flashinfer(out, _as_wheel(found[0], Path(tmp)))
    dst = out / "flashinfer"
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith("/") or not any(fnmatch.fnmatch(name, p) for p in FLASHINFER_KEEP):
                continue
            if any(fnmatch.fnmatch(name, p) for p in FLASHINFER_DROP):
                continue
            target = dst / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
    return wheel.name


def _as_wheel(path: Path, tmp: Path) -> Path:
    if path.suffix == ".whl":
        return path
    # An sdist: build a wheel from it (no compilation: flashinfer JIT-compiles on first use).
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    str(path), "--wheel-dir", str(tmp / "built")], check=True)
    return next((tmp / "built").glob("*.whl"))


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build(out: Path, from_env: bool = False, flashinfer: str | None = "download",
          pythons=PYTHONS) -> dict:
    """Stage a bundle into `out` (replaced); → the manifest. flashinfer: "download", a wheel
    path, or None (leave it out: the check then runs the torch-only steps)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    stage_project(out)
    if from_env:
        stage_from_env(out)
    else:
        stage_wheels(out, pythons)
    fi = None
    if flashinfer is not None:
        fi = stage_flashinfer(out, None if flashinfer == "download" else Path(flashinfer))
    parts = {p.name: tree_bytes(p) for p in out.iterdir() if p.is_dir()}
    manifest = {"packages": PACKAGES, "from_env": from_env, "pythons": list(pythons) if not from_env else
                [f"{sys.version_info.major}.{sys.version_info.minor}"], "flashinfer": fi,
                "bytes": parts, "total_bytes": sum(parts.values()), "limit_bytes": LIMIT_BYTES}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if manifest["total_bytes"] > LIMIT_BYTES:
        raise SystemExit(f"bundle is {manifest['total_bytes'] / 2**20:.1f} MB, over the {LIMIT_BYTES / 2**20:.0f} MB "
                         f"limit: {parts}")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "gpu_bundle"), help="bundle directory (replaced)")
    parser.add_argument("--from-env", action="store_true",
                        help="copy this environment's installed packages instead of downloading wheels")
    parser.add_argument("--flashinfer-wheel", help="a flashinfer-python wheel to trim (default: pip download "
                                                   f"flashinfer-python=={FLASHINFER_VERSION})")
    parser.add_argument("--no-flashinfer", action="store_true", help="leave flashinfer out")
    parser.add_argument("--python", action="append", help=f"target Python versions (default {', '.join(PYTHONS)})")
    args = parser.parse_args(argv)
    flashinfer = None if args.no_flashinfer else (args.flashinfer_wheel or "download")
    manifest = build(Path(args.out), args.from_env, flashinfer, tuple(args.python or PYTHONS))
    print(json.dumps(manifest, indent=2))
    print(f"bundle: {args.out} ({manifest['total_bytes'] / 2**20:.1f} MB); on the GPU machine: "
          f"python {args.out}/project/tools/gpu_check.py --bundle {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
