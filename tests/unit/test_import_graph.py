"""The services import only ``shared/`` and ``kernels/`` from outside themselves.

The coordinator and the worker are separate processes and images: an import from one into
the other would drag its dependencies (torch into the coordinator, the ledger core into the
worker) and couple their releases. Product-wide tools (``kvledger/``: CLI, dev supervisor,
planner, references) may import anything; so may tests and benchmarks. Every import counts,
at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: package → the top-level project packages it may import (besides itself).
ALLOWED = {
    "coordinator": {"shared", "kernels", "migrations"},   # migrations: the schema of its own log
    "worker": {"shared", "kernels"},
    "gateway": {"shared"},
    "kernels": {"shared"},
    "shared": set(),
    "migrations": {"shared", "coordinator"},
}
PROJECT = {"coordinator", "worker", "gateway", "kernels", "shared", "kvledger", "migrations", "bench", "tests"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & PROJECT


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_service_imports_only_shared_and_kernels(package: str) -> None:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for target in sorted(imports_of(path) - {package} - ALLOWED[package]):
            bad.append(f"{path.relative_to(REPO)} imports {target}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from worker.model import build_model\n    import coordinator.core\n")
    assert imports_of(f) == {"worker", "coordinator"}
