"""Greedy speculation equals plain decoding on every CPU the project may run on.

oneDNN (and our kernels' ISA variants) round differently on AMX, AVX512_CORE_BF16 (AMD Zen 4),
AVX512_CORE and AVX2 machines. Each case runs the real model in a process of its own with
ONEDNN_MAX_CPU_ISA capped (it must be set before the process starts): every drafter's greedy
output equals `none` token for token, batched and alone. A cap above what this machine has is
skipped, saying so. The slower ISAs run fewer prompts and tokens to keep CI short.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlap.kernels import cpu_flags

WORKER = Path(__file__).resolve().parents[1] / "exactness_worker.py"

# cap (with the avx512bf16 build's arithmetic after a dash: both run wherever that build
# does, whichever one the machine would choose), the CPU flags it needs, (prompts, tokens,
# prompts also run alone)
CAPS = [
    ("AVX512_CORE_AMX", {"amx_tile", "amx_bf16", "avx512_bf16"}, (12, 64, 4)),
    ("AVX512_CORE_BF16-dot", {"avx512_bf16", "avx512f"}, (6, 48, 2)),
    ("AVX512_CORE_BF16-fma", {"avx512_bf16", "avx512f"}, (4, 40, 1)),
    ("AVX512_CORE", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, (4, 40, 1)),
    ("AVX2", {"avx2", "fma"}, (4, 40, 1)),
]


def run_worker(cap: str, prompts: int, tokens: int, alone: int) -> dict:
    cap, _, arithmetic = cap.partition("-")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap}
    if arithmetic:
        env["OVERLAP_BF16_ARITHMETIC"] = arithmetic
    proc = subprocess.run([sys.executable, str(WORKER), "--prompts", str(prompts), "--tokens", str(tokens),
                           "--alone", str(alone), "--batch", "8"],
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("cap,needs,size", CAPS, ids=[c[0] for c in CAPS])
def test_greedy_speculation_equals_plain_under_isa_cap(cap, needs, size):
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run the {cap} kernels (lacks {' '.join(sorted(missing))})")
    out = run_worker(cap, *size)
    reference = out["modes"]["none"]["batched"]
    assert out["modes"]["none"]["alone"] == reference[: len(out["modes"]["none"]["alone"])], \
        f"{cap}/{out['variant']}: plain decoding alone differs from batched"
    for mode, got in out["modes"].items():
        for how in ("batched", "alone"):
            for i, ids in enumerate(got[how]):
                assert ids == reference[i], (
                    f"{cap} (kernels {out['variant']}): {mode} {how} differs from none on prompt {i} "
                    f"at token {next(t for t, (a, b) in enumerate(zip(ids, reference[i])) if a != b)}")
