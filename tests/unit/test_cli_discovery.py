"""``kvledger.discovery``: which stack an operator command belongs to, and how ``events`` shows a
transition. Real files and processes (this test's own pid is a live supervisor; a finished child's
is a dead one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.discovery import NoStack, find_stack, found_from
from kvledger.event_view import transition


def write_stack(state_dir: Path, pid: int, url: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "stack.json").write_text(json.dumps({"supervisor_pid": pid, "coordinator_url": url}))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_nearest_state_dir_at_or_above_the_working_directory(tmp_path: Path) -> None:
    import os

    write_stack(tmp_path / "repo" / ".kvl-state", os.getpid(), "http://127.0.0.1:1111")
    deep = tmp_path / "repo" / "a" / "b"
    deep.mkdir(parents=True)
    found = find_stack(cwd=deep, env={})
    assert found is not None and found.coordinator_url == "http://127.0.0.1:1111"
    assert found.found_by == "working directory" and found.state_dir == (tmp_path / "repo" / ".kvl-state")
    assert find_stack(cwd=tmp_path, env={}) is None or find_stack(cwd=tmp_path, env={}).state_dir != found.state_dir
    assert found_from(found.state_dir, deep) and not found_from(found.state_dir, tmp_path)
    # a nearer .kvl-state (a nested checkout) wins; a stale one (its supervisor gone) is skipped
    write_stack(tmp_path / "repo" / "a" / ".kvl-state", dead_pid(), "http://127.0.0.1:2222")
    assert find_stack(cwd=deep, env={}).coordinator_url == "http://127.0.0.1:1111"
    write_stack(tmp_path / "repo" / "a" / ".kvl-state", os.getpid(), "http://127.0.0.1:2222")
    assert find_stack(cwd=deep, env={}).coordinator_url == "http://127.0.0.1:2222"


def test_a_named_stack_wins_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    import os

    write_stack(tmp_path / ".kvl-state", os.getpid(), "http://127.0.0.1:1111")
    write_stack(tmp_path / "other", os.getpid(), "http://127.0.0.1:3333")
    assert find_stack("other", cwd=tmp_path, env={}).coordinator_url == "http://127.0.0.1:3333"
    via_env = find_stack(cwd=tmp_path, env={"KVLEDGER_STATE_DIR": str(tmp_path / "other")})
    assert via_env.coordinator_url == "http://127.0.0.1:3333" and via_env.found_by == "$KVLEDGER_STATE_DIR"
    assert find_stack(None, "other", cwd=tmp_path, env={}).found_by == "config"
    with pytest.raises(NoStack, match="no stack.json there"):
        find_stack("nowhere", cwd=tmp_path, env={})
    write_stack(tmp_path / "stale", dead_pid(), "http://127.0.0.1:4444")
    with pytest.raises(NoStack, match="no longer runs"):
        find_stack(cwd=tmp_path, env={"KVLEDGER_STATE_DIR": str(tmp_path / "stale")})


def test_events_show_their_transition() -> None:
    applied = {"type": "transition.applied", "event": {"transition": {
        "form": "compressed", "location": "gpu:w0", "block_hash": "ab" * 16, "from_state": "ALLOCATED",
        "to_state": "READY"}}}
    assert transition(applied).startswith("ALLOCATED → READY  compressed@gpu:w0 abababababab")
    rejected = {"type": "transition.rejected", "event": {"reason": "stale", "transition": {
        "form": "tail", "location": "disk", "block_hash": "cd" * 16, "to_state": "READY"}}}
    assert transition(rejected).startswith("absent → READY") and "REJECTED: stale" in transition(rejected)
    grant = {"type": "lease.granted", "event": {"allocated": True, "write": {"compressed": [0, 1], "tail": [1]},
                                                 "evicted": [["x", "compressed", 0]], "read": []}}
    assert transition(grant) == "absent → ALLOCATED ×3  READY → EVICTED ×1"
    assert transition({"type": "worker.lost", "event": {"epoch": 2, "lost": [1, 2]}}) == \
        "epoch 2 → LOST; replicas → LOST ×2"
    assert transition({"type": "lease.renewed", "event": {}}) == ""
