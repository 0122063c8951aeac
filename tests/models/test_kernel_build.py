"""The CPU kernels' on-disk build cache survives a process killed while building; the avx512bf16
build runs the arithmetic chosen for the machine (or asked for)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlap import kernels


def _build_dir() -> Path:
    """Where this process's kernel library was built (built now if it was not)."""
    return Path(kernels._library().__file__).parent


def test_a_build_lock_left_by_a_killed_process_does_not_block_the_next_load():
    # torch's extension builder locks with a plain file; a process killed mid-build leaves it,
    # and torch alone would then wait on it forever (a CI run once hung here for 90 minutes).
    stale = _build_dir() / "lock"
    stale.touch()
    try:
        load = subprocess.run(
            [sys.executable, "-c", "from overlap import kernels; print(kernels.variant_name())"],
            capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the kernels waited on the stale build lock")
    finally:
        stale.unlink(missing_ok=True)
    assert load.returncode == 0, load.stderr
    assert load.stdout.strip() == kernels.variant_name()
    assert "removing a build lock left by a process that died" in load.stderr


def test_the_avx512bf16_build_takes_fmas_on_intel_and_dot_products_elsewhere():
    choose = kernels.choose_arithmetic
    assert choose(2, "GenuineIntel", None) == "fma"  # vdpbf16ps at half the FMAs' rate there
    assert choose(2, "AuthenticAMD", None) == "dot"
    assert choose(2, "GenuineIntel", "dot") == "dot" and choose(2, "AuthenticAMD", "fma") == "fma"
    for variant in (3, 1, 0, -1):  # one arithmetic each: nothing to choose
        assert choose(variant, "GenuineIntel", None) is None
    with pytest.raises(ValueError, match="OVERLAP_BF16_ARITHMETIC='fast'"):
        choose(2, "GenuineIntel", "fast")


def test_the_tiles_prefetch_into_l2_on_intel_and_into_l1_elsewhere():
    assert kernels.choose_prefetch("GenuineIntel", None) == "l2"
    assert kernels.choose_prefetch("AuthenticAMD", None) == "l1"
    assert kernels.choose_prefetch("GenuineIntel", "l1") == "l1"
    with pytest.raises(ValueError, match="OVERLAP_KERNEL_PREFETCH='l3'"):
        kernels.choose_prefetch("AuthenticAMD", "l3")


@pytest.mark.skipif(kernels.machine_variant() != 2, reason="only the avx512bf16 build has two arithmetics")
@pytest.mark.parametrize("arithmetic,prefetch", [("dot", "l2"), ("fma", "l1")])
def test_the_arithmetic_and_prefetch_asked_for_are_what_a_new_process_runs(arithmetic, prefetch):
    load = subprocess.run(
        [sys.executable, "-c", "from overlap import kernels; lib = kernels._library(); "
                               "print(kernels.kernels_name(), lib.fma_pairs(), lib.prefetch_l2())"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OVERLAP_BF16_ARITHMETIC": arithmetic, "OVERLAP_KERNEL_PREFETCH": prefetch})
    assert load.returncode == 0, load.stderr
    name = f"avx512bf16-{arithmetic}" + ("-l2" if prefetch == "l2" else "")
    assert load.stdout.split() == [name, str(arithmetic == "fma"), str(prefetch == "l2")]
