"""A child started with ``parent_death_signal`` dies with the process that started it, even when
that process is killed with SIGKILL (what a killed test run or supervisor would otherwise leave
behind: orphans holding ports and the leader lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from shared.child_process import parent_death_signal
    pre = parent_death_signal() if sys.argv[1] == "signal" else None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                             preexec_fn=pre)
    print(child.pid, flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _orphan_after_parent_killed(mode: str, wait_s: float) -> tuple[int, bool]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + wait_s
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    return child, _alive(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux prctl")
def test_child_dies_with_its_killed_parent() -> None:
    _, alive = _orphan_after_parent_killed("signal", 5.0)
    assert not alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux prctl")
def test_without_it_the_child_outlives_its_parent() -> None:
    """The control: what the harness's stacks did before (so the test above can fail)."""
    child, alive = _orphan_after_parent_killed("none", 1.0)
    try:
        assert alive
    finally:
        if alive:
            os.kill(child, signal.SIGKILL)
