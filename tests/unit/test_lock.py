"""The hashed lock files (deploy/lock.py, requirements/*.lock) against pyproject.toml.

The checked-in locks are current; a dependency added or tightened in pyproject.toml without
re-locking, or an entry without its hash, is found; the image's selection drops a package and
what only it needed, and keeps every other dependency with its hashes.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("deploy_lock", ROOT / "deploy" / "lock.py")
assert _spec is not None and _spec.loader is not None
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)


def copy(tmp: Path) -> tuple[Path, Path]:
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    shutil.copytree(ROOT / "requirements", tmp / "requirements")
    return tmp / "pyproject.toml", tmp / "requirements"


def test_the_checked_in_locks_match_pyproject() -> None:
    assert lock.problems(ROOT / "pyproject.toml", ROOT / "requirements") == []
    for name in ("run.lock", "test.lock", "test-nodeps.lock"):
        pins = lock.entries((ROOT / "requirements" / name).read_text())
        assert pins and all(hashes for _, _, hashes, _ in pins.values())
    # what make install installs today: torch is the pinned release (this machine's CPU build)
    version = lock.entries((ROOT / "requirements" / "run.lock").read_text())["torch"][0]
    assert version.split("+")[0] == "2.13.0"


def test_a_dependency_added_without_relocking_is_found(tmp_path: Path) -> None:
    pyproject, locks = copy(tmp_path)
    text = pyproject.read_text()
    pyproject.write_text(text.replace('dependencies = [\n', 'dependencies = [\n    "left-pad-example>=1",\n', 1))
    found = lock.problems(pyproject, locks)
    assert "run.lock was made from other pyproject.toml dependencies than today's" in found
    assert "test.lock: left-pad-example is not locked" in found


def test_a_tightened_dependency_and_a_missing_hash_are_found(tmp_path: Path) -> None:
    pyproject, locks = copy(tmp_path)
    pyproject.write_text(re.sub(r'"aiohttp>=[^"]*"', '"aiohttp>=99"', pyproject.read_text(), count=1))
    run = locks / "run.lock"
    run.write_text(re.sub(r"(^xxhash==\S+) \\\n(    --hash=\S+( \\)?\n)+", r"\1\n", run.read_text(), flags=re.M))
    found = lock.problems(pyproject, locks)
    assert any(p.startswith("run.lock: aiohttp==") and "(aiohttp>=99)" in p for p in found), found
    assert "run.lock: xxhash has no hash" in found


def test_the_image_selection_drops_a_package_and_what_only_it_needed() -> None:
    run = lock.entries((ROOT / "requirements" / "run.lock").read_text())
    only_torch = {n for n, (_, _, _, via) in run.items() if via == {"torch"}}
    assert only_torch   # e.g. sympy: nothing else needs it
    picked = lock.entries(lock.select(ROOT / "requirements" / "run.lock", {"torch", "triton"}))
    assert "torch" not in picked and "triton" not in picked and not only_torch & set(picked)
    assert {"aiohttp", "sqlalchemy", "nats-py", "multidict"} <= set(picked)   # multidict: aiohttp's
    assert all(hashes for _, _, hashes, _ in picked.values())
    assert picked["aiohttp"][2] == run["aiohttp"][2]
