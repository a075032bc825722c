"""The core is pure: importing it pulls in no I/O library, and no module reads the clock."""

import ast
import json
import pathlib
import subprocess
import sys

import coordinator.core

CORE = pathlib.Path(coordinator.core.__file__).parent
FORBIDDEN = ("asyncio", "aiohttp", "nats", "sqlalchemy", "asyncpg", "structlog", "alembic", "socket",
             "threading", "subprocess", "time", "datetime", "random", "os", "io", "pathlib", "logging")


def test_importing_the_core_loads_no_io_library() -> None:
    code = ("import sys, json; import coordinator.core; "
            "print(json.dumps(sorted(m for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         stdin=subprocess.DEVNULL, cwd=CORE.parent.parent)
    loaded = set(json.loads(out.stdout))
    bad = sorted(m for m in loaded if m.split(".")[0] in {"asyncio", "aiohttp", "nats", "sqlalchemy",
                                                          "asyncpg", "structlog", "alembic"})
    assert bad == [], f"the pure core imports I/O libraries: {bad}"


def test_core_modules_import_nothing_that_does_io_or_reads_a_clock() -> None:
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
            if isinstance(node, ast.Attribute) and node.attr in ("time", "time_ns", "monotonic", "now", "now_ms"):
                if isinstance(node.value, ast.Name) and node.value.id in ("time", "datetime", "m"):
                    raise AssertionError(f"{path.name}:{node.lineno} reads a clock ({ast.unparse(node)})")
