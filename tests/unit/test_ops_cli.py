"""The operator commands without services: the admin CLI against a stub of the admin REST API
(what it sends, what it prints, its one-line errors and exit codes), and the supervisor's
helpers (log rendering, URL redaction, a busy port refused before anything starts)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import kvledger.admin_cli as admin_cli
from kvledger.cli import main
from kvledger.stack.console import Console, render_log_line
from kvledger.stack.options import StackOptions
from kvledger.stack.report import redact_url
from kvledger.stack.supervisor import Stack
from shared.config import parse_config
from shared.embedded import free_port


class Stub:
    """Answers (status, JSON) per (method, path); records every request."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Any] = {}
        self.requests: list[dict[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                path, _, query = self.path.partition("?")
                stub.requests.append({"method": self.command, "path": path, "query": query, "body": body,
                                      "auth": self.headers.get("Authorization")})
                answer = stub.routes.get((self.command, path), (404, {"error": {"code": "not_found",
                                                                                "message": "no route"}}))
                status, doc = answer(query) if callable(answer) else answer
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.server.shutdown()


def run(stub: Stub, *argv: str) -> int:
    return main([*argv, "--coordinator-url", stub.url])


WORKER = {"worker_id": "worker-0", "epoch": 3, "alive": True, "draining": False, "namespace": "ab" * 16,
          "model_id": "kvledger/dsv4-tiny", "forms": ["compressed"], "endpoint": "http://127.0.0.1:8400",
          "node": "n", "registered_at_ms": 1, "last_heartbeat_ms": 1, "pool_slots": {}, "gpu_replicas": 7,
          "leases": 1, "committed_seq": 9}


def test_tables_for_people_json_for_scripts(stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    stub.routes[("GET", "/v1/workers")] = (200, {"workers": [WORKER]})
    assert run(stub, "workers") == 0
    out = capsys.readouterr().out
    assert "worker-0" in out and "http://127.0.0.1:8400" in out and "workers (1)" in out
    assert run(stub, "workers", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"workers": [WORKER]}


def test_token_and_request_bodies(stub: Stub, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVL_ADMIN_TOKEN", "s3cret")
    stub.routes[("POST", "/v1/invalidate")] = (200, {"scope": "namespace", "value": "ab" * 16, "affected": 4,
                                                     "workers_notified": {"worker-0": "ok"}})
    assert run(stub, "invalidate", "--namespace", "ab" * 16, "--reason", "weights changed") == 0
    assert "invalidated 4 replica(s) of namespace" in capsys.readouterr().out
    req = stub.requests[-1]
    assert req["auth"] == "Bearer s3cret"
    assert req["body"] == {"scope": "namespace", "value": "ab" * 16, "reason": "weights changed"}

    stub.routes[("POST", "/v1/workers/worker-0/drain")] = (200, {"worker_id": "worker-0", "draining": True,
                                                                 "changed": True, "control": "ok"})
    assert run(stub, "drain", "worker-0", "--token", "other") == 0
    assert stub.requests[-1]["auth"] == "Bearer other"

    stub.routes[("POST", "/v1/snapshot")] = (200, {"position": 12, "state_hash": "h", "bytes": 2048})
    assert run(stub, "snapshot") == 0
    assert "snapshot saved at log position 12" in capsys.readouterr().out


def test_one_line_errors(stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert main(["workers", "--coordinator-url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvledger: coordinator not reachable at http://127.0.0.1:{port} (Connection refused); "
                   "is it running? (kvledger up)"]

    stub.routes[("GET", "/v1/pools")] = (401, {"error": {"code": "unauthorized", "message": "admin API: wrong "
                                                                                              "bearer token"}})
    assert run(stub, "pools") == 1
    err = capsys.readouterr().err
    assert "refused the request: admin API: wrong bearer token" in err and "KVL_ADMIN_TOKEN" in err

    stub.routes[("GET", "/v1/leases")] = (503, {"error": {"code": "standby", "message": "standby: not the leader"}})
    assert run(stub, "leases") == 1
    assert "is not serving right now: standby: not the leader" in capsys.readouterr().err

    stub.routes[("GET", "/v1/blocks")] = (400, {"error": {"code": "invalid", "message": "query parameter 'state' "
                                                                                        "must be one of [...]"}})
    assert run(stub, "blocks", "--state", "nope") == 1
    assert capsys.readouterr().err.strip() == "kvledger: query parameter 'state' must be one of [...] (HTTP 400)"


def test_audit_exit_code_and_report(stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    report = {"ok": True, "position": 10, "live_hash": "h", "replay_hash": "h", "hash_match": True,
              "replay_from": "empty", "log_errors": [], "replayed_events": 10, "replay_seconds": 0.01,
              "invariant_violations": [], "replay_invariant_violations": [], "workers_checked": ["worker-0"],
              "workers_unreachable": {}, "drift": {}, "duration_ms": 12.0}
    stub.routes[("GET", "/readyz")] = (200, {"ready": True, "position": 10})
    stub.routes[("POST", "/v1/audit")] = (200, report)
    assert run(stub, "audit", "--from", "snapshot", "--no-workers") == 0
    assert "CLEAN" in capsys.readouterr().out
    assert stub.requests[-1]["body"] == {"replay_from": "snapshot", "check_workers": False, "timeout_ms": 2000}

    bad = {**report, "ok": False, "hash_match": False, "replay_hash": "x",
           "drift": {"worker-0": {"missing_on_worker": {"count": 2, "replicas": []},
                                  "tiers": {"host:worker-0": {"ledger_only": 2, "worker_only": 0}}}},
           "inventory": {"worker-0": {"gpu:worker-0": {"ledger_ready": 71, "worker": 71},
                                      "host:worker-0": {"ledger_ready": 23, "worker": 21}}},
           "disk": {"ledger_ready": 584, "checked": 64, "worker": "worker-0", "sampled": True,
                    "missing": {"count": 1, "replicas": [["ab" * 16, "swa", "disk"]]}, "damaged": {"count": 0}}}
    stub.routes[("POST", "/v1/audit")] = (200, bad)
    assert run(stub, "audit", "--disk-checks", "8") == 3
    out = capsys.readouterr().out
    assert "PROBLEMS FOUND" in out and "DIFFERENT" in out and "drift on worker-0: missing_on_worker: 2" in out
    assert "host:worker-0: 2 listed READY but not held, 0 held but not listed" in out
    assert "64 of 584 READY files verified by worker-0 (a sample): missing 1, damaged 0" in out
    assert "host:worker-0 23/21" in out and f"disk missing: {'ab' * 16} swa disk" in out
    assert stub.requests[-1]["body"]["disk_checks"] == 8


def test_events_follow_polls_after_the_last_position(stub: Stub, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def event(pos: int) -> dict[str, Any]:
        return {"position": pos, "stream_id": f"replica:{pos}", "stream_version": 1, "type": "replica_committed",
                "source_id": f"w.1.{pos}", "leader_epoch": 1, "recorded_at": "2026-01-01T00:00:00+00:00",
                "event": {}}

    def events(query: str) -> tuple[int, Any]:
        after = int(dict(p.split("=") for p in query.split("&"))["after"])
        batch = [event(p) for p in range(after + 1, min(after + 3, 15) + 1)]
        return 200, {"events": batch, "next_after": batch[-1]["position"] if batch else after}

    stub.routes[("GET", "/readyz")] = (200, {"position": 12})
    stub.routes[("GET", "/v1/events")] = events
    sleeps = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(admin_cli.time, "sleep", sleep)
    assert run(stub, "events", "--follow", "--limit", "3", "--interval", "0.5", "--json") == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [e["position"] for e in lines] == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # tail -f: 10 back
    assert sleeps == [0.5, 0.5]


def test_log_lines_are_rendered_readably() -> None:
    level, text = render_log_line('{"event": "registered", "level": "info", "timestamp": '
                                  '"2026-01-01T10:11:12.5Z", "worker_id": "w0", "pools": {"swa": 3}}\n')
    assert level == "info" and text == '10:11:12 info    registered  worker_id=w0 pools={"swa":3}'
    assert render_log_line("listening on http://127.0.0.1:8400") == ("info", "listening on http://127.0.0.1:8400")
    assert render_log_line("Traceback (most recent call last):")[0] == "error"
    assert redact_url("postgresql://kvl:hunter2@db:5432/kvl") == "postgresql://kvl:***@db:5432/kvl"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_a_busy_port_is_refused_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        cfg = parse_config({"state_dir": str(tmp_path / "state")})
        code = Stack(cfg, StackOptions(workers=1, coordinator_port=busy), console=Console()).run()
    assert code == 2
    out = capsys.readouterr().out
    assert f"port {busy} on 127.0.0.1 is in use" in out and "--coordinator-port" in out
    assert not (tmp_path / "state").exists()  # no embedded service was started


def _sleeper(*tail: str) -> subprocess.Popen[bytes]:
    """A process whose command line ends with ``tail`` (waited for: before exec it shows ours)."""
    import psutil

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *tail], start_new_session=True)
    deadline = time.monotonic() + 20
    while psutil.Process(p.pid).cmdline()[-len(tail):] != list(tail):
        assert time.monotonic() < deadline, "the sleeper did not start"
        time.sleep(0.01)
    return p


def test_leftovers_of_a_killed_supervisor_are_stopped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvledger up` killed with SIGKILL leaves stack.json behind; the next one stops what it lists
    (only processes that look like the named service and are older than the file)."""
    state = tmp_path / "state"
    state.mkdir()
    worker = _sleeper("-m", "worker")
    unrelated = _sleeper("-m", "something-else")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        time.sleep(0.05)  # the file is newer than the processes it lists
        (state / "stack.json").write_text(json.dumps({"supervisor_pid": dead.pid, "services": [
            {"name": "worker-0", "pid": worker.pid}, {"name": "worker-1", "pid": unrelated.pid}]}))
        stack = Stack(parse_config({"state_dir": str(state)}), StackOptions(), console=Console())
        stack.clean_stale()
        worker.wait(20)  # stopped (reaped by the supervisor's wait, so its return code is lost here)
        assert unrelated.poll() is None  # not what stack.json said it was: left alone
        assert not (state / "stack.json").exists()
        assert "was killed and left processes running" in capsys.readouterr().out
    finally:
        for p in (worker, unrelated):
            p.kill()
            p.wait()


def test_a_running_supervisor_keeps_its_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    other = _sleeper("kvledger", "up")
    try:
        (state / "stack.json").write_text(json.dumps({"supervisor_pid": other.pid, "services": []}))
        code = Stack(parse_config({"state_dir": str(state)}), StackOptions(), console=Console()).run()
        assert code == 2 and other.poll() is None and (state / "stack.json").exists()
    finally:
        other.kill()
        other.wait()
