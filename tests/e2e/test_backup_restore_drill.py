"""The backup-and-restore drill of docs/operations.md ("Backup and restore of the log"), run for real
(issue 55, item 8): a coordinator and a worker serve cached requests; ``pg_dump`` of the log's
database; ``pg_restore`` into a fresh one; ``kvledger replay`` of the copy folds to the same head
and state hash, its hash chain unbroken; a coordinator started on the copy takes over, the
worker that kept running resumes under it, and ``kvledger audit`` is clean (the chain included).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.conftest import prompt
from tests.worker.processes import REPO, Cluster

KVLEDGER = [sys.executable, "-m", "kvledger.cli"]


@pytest.fixture
async def cluster(tmp_path, database_url, nats_url, subjects):
    c = Cluster(tmp_path, database_url, nats_url, subjects)
    await c.connect()
    try:
        yield c
    finally:
        c.stop_all()
        await c.close()


def pg_tool(name: str) -> str:
    """The PostgreSQL client program: the system's, else the one the embedded server ships."""
    found = shutil.which(name)
    if found:
        return found
    import pgserver

    path = Path(pgserver.__file__).parent / "pginstall" / "bin" / name
    assert path.exists(), f"{name} not found on PATH nor in pgserver ({path})"
    return str(path)


def kvledger(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVL_")}
    return subprocess.run([*KVLEDGER, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def libpq(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def test_dump_restore_replay_audit(cluster, database_url, other_database_url, tmp_path) -> None:
    cluster.start_coordinator()
    cluster.start_worker("wa", cache={"offload_dir": ""})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wa")
    for seed in range(3):
        p = prompt(80, seed=200 + seed)
        await cluster.generate("wa", p)
        assert (await cluster.generate("wa", p))["cached_tokens"] == 64       # cached: the log has the commits
    assert await cluster.flush("wa")
    original = kvledger("replay", "--database-url", libpq(database_url), "--json")
    assert original.returncode == 0, original.stdout + original.stderr
    before = json.loads(original.stdout)
    assert before["ok"] and before["head"] > 10 and before["replicas"] > 0

    # the backup, as the docs say, and the restore into an empty database
    dump = tmp_path / "kvledger.dump"
    out = subprocess.run([pg_tool("pg_dump"), "--format=custom", "--file", str(dump), libpq(database_url)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cluster.stop_coordinator()                                                   # step 1: stop every coordinator
    out = subprocess.run([pg_tool("pg_restore"), "--exit-on-error", "--dbname", libpq(other_database_url),
                          str(dump)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

    # step 3: the copy folds to the same end, the same state, no stream error, no invariant broken
    restored = kvledger("replay", "--database-url", libpq(other_database_url), "--json")
    assert restored.returncode == 0, restored.stdout + restored.stderr
    after = json.loads(restored.stdout)
    assert after["ok"] and not after["stream_errors"] and not after["invariant_violations"]
    assert (after["head"], after["position"], after["state_hash"]) == (before["head"], before["head"],
                                                                        before["state_hash"])

    # step 4: a coordinator on the copy; the worker that kept running resumes under it
    cluster.database_url = other_database_url
    cluster.start_coordinator()
    await cluster.wait_coordinator()
    await cluster.wait_worker("wa", contact="reachable")
    p = prompt(80, seed=200)
    got = await cluster.generate("wa", p)
    assert got["cached_tokens"] == 64, {k: got.get(k) for k in ("cached_tokens", "fallbacks", "degraded")}
    assert await cluster.flush("wa")
    audit = kvledger("audit", "--coordinator-url", f"http://127.0.0.1:{cluster.admin_port}", "--json")
    report = json.loads(audit.stdout)
    assert audit.returncode == 0 and report["ok"], audit.stdout + audit.stderr
    assert report["chain"]["ok"] and report["chain"]["head_position"] > before["head"], report["chain"]
