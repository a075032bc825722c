"""`kvledger up` restarts what dies, as an operator would, and runs standby coordinators.

Each test brings up a stack on configured PostgreSQL/NATS and kills one of its processes with
SIGKILL: a worker comes back on its port with its worker id and registers again; the
coordinator comes back and serves again; with ``--coordinators 2`` the standby takes the lead
and the killed leader, restarted, becomes the standby. Each time the stack stays up, the
restart is counted (console, stack.json, the child's log), and a SIGTERM then stops
everything with exit 0 and nothing left. A process that keeps dying: test_stack_up.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvledger.stack.probes import http_json
from shared.subjects import Subjects
from tests.e2e.test_stack_up import UP_READY, UpProcess, kvledger, still_running, ups  # noqa: F401 - fixture

T = TypeVar("T")


def eventually(what: str, probe: Callable[[], T | None], timeout_s: float = 30) -> T:
    """``probe()`` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.2)


def start(tmp_path: Path, database_url: str, nats_url: str, subjects: Subjects, *args: str) -> UpProcess:
    return UpProcess(tmp_path, {"database": {"url": database_url},
                                "nats": {"url": nats_url, "subject_prefix": subjects.prefix},
                                "worker": {"pool_bytes": 4 * 2**20}}, "--quiet", *args)


def service(up: UpProcess, name: str) -> dict[str, Any]:
    return next(s for s in up.stack()["services"] if s["name"] == name)


def restarted(up: UpProcess, name: str, old_pid: int) -> dict[str, Any] | None:
    """Its stack.json row once it runs again under a new pid."""
    row = service(up, name)
    return row if row["pid"] not in (None, old_pid) else None


def worker_ready(url: str) -> bool:
    status, body = http_json(f"{url}/readyz")
    return status == 200 and body.get("coordinator") == "reachable"


def readyz_status(url: str) -> tuple[int, Any]:
    status, body = http_json(f"{url}/readyz")
    return status, body.get("status") if isinstance(body, dict) else None


def stop_cleanly(up: UpProcess, tree: list[Any], processes: int) -> str:
    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(90) == 0, up.output()[-4000:]
    up._reader.join(5)
    out = up.output()
    assert f"none of the {processes} processes it started is left" in out, out[-3000:]
    assert still_running(tree) == []
    return out


def exits_logged(up: UpProcess, name: str) -> list[dict[str, Any]]:
    lines = (up.state / "logs" / f"{name}.log").read_text().splitlines()
    return [doc for doc in map(json.loads, filter(lambda line: line.startswith("{"), lines))
            if doc.get("event") == "process_exited"]


def test_a_killed_worker_is_restarted_on_its_port_and_registers_again(
        tmp_path: Path, ups: list[UpProcess], database_url: str, nats_url: str, subjects: Subjects) -> None:
    up = start(tmp_path, database_url, nats_url, subjects, "--workers", "1")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=180)
    stack = up.stack()
    url = stack["worker_urls"][0]
    old, coordinator = service(up, "worker-0"), service(up, "coordinator")
    assert old["restarts"] == 0 and coordinator["restarts"] == 0
    assert "restarts" in up.output()  # the table's column

    os.kill(old["pid"], signal.SIGKILL)
    up.wait_for(f"worker-0 (pid {old['pid']}) exited (code -9); restarting in 0.5s (restart 1)", timeout_s=10)
    row = eventually("worker-0 runs again", lambda: restarted(up, "worker-0", old["pid"]))
    assert row["restarts"] == 1 and row["url"] == url
    eventually(f"{url}/readyz 200 with the coordinator reachable", lambda: worker_ready(url), timeout_s=60)
    assert up.stack()["worker_urls"] == [url]
    assert service(up, "coordinator")["pid"] == coordinator["pid"]  # the others kept running
    assert up.popen.poll() is None
    assert f"worker-0 restarted (pid {row['pid']}, restart 1)" in up.output()
    assert [(e["exit_code"], e["action"], e["restart"]) for e in exits_logged(up, "worker-0")] == \
        [(-9, "restarting", 1)]
    workers = kvledger("workers", "--coordinator-url", stack["coordinator_url"], "--json")
    assert workers.returncode == 0, workers.stderr
    assert [w["worker_id"] for w in json.loads(workers.stdout)["workers"] if w["alive"]] == ["worker-0"]

    out = stop_cleanly(up, up.tree(), processes=4)
    assert "worker-0 stopped (exit code 0, restarted 1 time(s))" in out


def test_a_killed_coordinator_is_restarted_and_serves_again(
        tmp_path: Path, ups: list[UpProcess], database_url: str, nats_url: str, subjects: Subjects) -> None:
    up = start(tmp_path, database_url, nats_url, subjects, "--workers", "1")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=180)
    stack = up.stack()
    curl, wurl = stack["coordinator_url"], stack["worker_urls"][0]
    old, worker = service(up, "coordinator"), service(up, "worker-0")
    tree = up.tree()

    os.kill(old["pid"], signal.SIGKILL)
    up.wait_for(f"coordinator (pid {old['pid']}) exited (code -9); restarting in 0.5s (restart 1)", timeout_s=10)
    row = eventually("the coordinator runs again", lambda: restarted(up, "coordinator", old["pid"]))
    assert row["restarts"] == 1 and row["url"] == curl
    eventually(f"{curl}/readyz 200", lambda: readyz_status(curl)[0] == 200, timeout_s=60)
    eventually(f"{wurl}/readyz 200 with the coordinator reachable", lambda: worker_ready(wurl), timeout_s=60)
    assert service(up, "worker-0")["pid"] == worker["pid"]  # the others kept running
    assert up.popen.poll() is None

    stop_cleanly(up, tree + up.tree(), processes=4)


def test_two_coordinators_one_leads_and_the_standby_takes_over_when_it_is_killed(
        tmp_path: Path, ups: list[UpProcess], database_url: str, nats_url: str, subjects: Subjects) -> None:
    up = start(tmp_path, database_url, nats_url, subjects, "--workers", "0", "--coordinators", "2")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=180)
    stack = up.stack()
    assert [s["name"] for s in stack["services"]] == ["postgres", "nats", "coordinator", "coordinator-2", "gateway"]
    first, second = stack["coordinator_urls"]
    assert stack["coordinator_url"] == first and first != second
    assert readyz_status(first) == (200, "serving")
    assert eventually("coordinator-2 standing by", lambda: readyz_status(second) == (503, "standby"))
    out = up.output()
    assert "coordinator-2 starting (pid" in out and "as a standby" in out
    assert f" workers --state-dir {up.state}" in out  # the hints name this stack (its stack.json: the first)
    leader = service(up, "coordinator")
    tree = up.tree()

    os.kill(leader["pid"], signal.SIGKILL)
    eventually("coordinator-2 leads", lambda: readyz_status(second)[0] == 200, timeout_s=30)
    eventually("the killed leader runs again", lambda: restarted(up, "coordinator", leader["pid"]))
    eventually("the restarted coordinator stands by", lambda: readyz_status(first) == (503, "standby"), timeout_s=30)
    assert readyz_status(second) == (200, "serving")  # exactly one leader
    assert service(up, "coordinator")["restarts"] == 1 and service(up, "coordinator-2")["restarts"] == 0
    assert up.popen.poll() is None

    stop_cleanly(up, tree + up.tree(), processes=4)


def complete(url: str, prompt: str) -> int:
    """One completion; its cached tokens."""
    req = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        body = json.loads(r.read())
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_embedded_nats_killed_is_restarted_and_the_worker_keeps_its_cache(
        tmp_path: Path, ups: list[UpProcess]) -> None:
    """The issue's own drill, as a user of `kvledger up` meets it (embedded services): warm, kill
    -9 nats-server, resend — the cache is still there."""
    up = UpProcess(tmp_path, {"worker": {"pool_bytes": 4 * 2**20}}, "--quiet", "--workers", "1")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=240)
    url = up.stack()["worker_urls"][0].removesuffix("/v1")
    prompts = [f"kvledger continuity prompt {i}: " + "the ledger keeps every form of cached state. " * 3
               for i in range(3)]
    for p in prompts:
        complete(url, p)
    before = sum(complete(url, p) for p in prompts)
    assert before > 0
    nats = service(up, "nats")
    os.kill(nats["pid"], signal.SIGKILL)
    up.wait_for("embedded nats exited", timeout_s=10)
    eventually("nats runs again", lambda: restarted(up, "nats", nats["pid"]), timeout_s=60)
    up.wait_for("embedded nats restarted", timeout_s=30)
    eventually(f"{url}/readyz 200 with the coordinator reachable", lambda: worker_ready(url), timeout_s=60)
    after = sum(complete(url, p) for p in prompts)
    assert after == before, (before, after)                      # 100 % retained
    assert up.popen.poll() is None
    stop_cleanly(up, up.tree(), processes=6)
