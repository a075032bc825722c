"""`kvledger up` with a NATS cluster: what a killed supervisor left of its nodes is found and stopped.

A node is listed in ``stack.json`` as ``nats-<i>``; the next ``kvledger up`` with the same state
dir stops it if its command line names that state dir (as every embedded node's does: its
configuration file lives there), and leaves alone a process that merely has the pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.stack.console import Console
from kvledger.stack.options import StackOptions
from kvledger.stack.supervisor import Stack
from shared.config import parse_config
from tests.unit.test_ops_cli import _sleeper


def test_leftover_nats_nodes_of_a_killed_supervisor_are_stopped(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    state.mkdir()
    node = _sleeper("-c", str(state / "nats" / "node-2" / "node.conf"))
    other = _sleeper("-c", "/elsewhere/node.conf")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        time.sleep(0.05)  # the file is newer than the processes it lists
        (state / "stack.json").write_text(json.dumps({"supervisor_pid": dead.pid, "services": [
            {"name": "nats-2", "pid": node.pid}, {"name": "nats-3", "pid": other.pid}]}))
        Stack(parse_config({"state_dir": str(state)}), StackOptions(), console=Console()).clean_stale()
        node.wait(20)
        assert other.poll() is None   # not a node of this state dir: left alone
        assert "was killed and left processes running" in capsys.readouterr().out
    finally:
        for p in (node, other):
            p.kill()
            p.wait()


def test_a_nats_cluster_with_a_configured_nats_url_is_refused(tmp_path: Path) -> None:
    """`--nats-cluster` runs embedded nodes: with nats.url set there is nothing to run (the
    operator lists their own cluster's servers in nats.url instead)."""
    config = tmp_path / "k.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\nnats: {{url: 'nats://a:4222,nats://b:4222'}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}   # the file says everything
    r = subprocess.run([sys.executable, "-m", "kvledger.cli", "up", "--config", str(config), "--nats-cluster", "3"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "nats.url is set" in r.stderr and "comma-separated" in r.stderr, r.stderr
    assert not (tmp_path / "state").exists()   # nothing was started
    r = subprocess.run([sys.executable, "-m", "kvledger.cli", "up", "--config", str(config), "--nats-cluster", "2"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "invalid choice: 2" in r.stderr, r.stderr
