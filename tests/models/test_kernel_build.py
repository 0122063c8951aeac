"""The CPU kernels' on-disk build cache survives a process killed while building."""

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
