"""The layering rule (docs/architecture.md): `runtime` imports `overlap`, never the reverse.
The engine knows no processes, sockets or requests."""

import ast
from pathlib import Path

import pytest

OVERLAP = Path(__file__).resolve().parents[1] / "overlap"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(OVERLAP.rglob("*.py")), ids=lambda p: str(p.relative_to(OVERLAP)))
def test_overlap_never_imports_runtime(path):
    bad = sorted(m for m in imported_modules(path) if m == "runtime" or m.startswith("runtime."))
    assert not bad, f"{path.relative_to(OVERLAP.parent)} imports {bad}"
