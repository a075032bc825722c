"""`kvledger up` as an operator runs it: the whole stack as one supervised process tree.

The first test runs the default path (no URLs configured: embedded PostgreSQL and NATS),
two workers, requests to both through the openai client, the admin commands against the
live coordinator (`kvledger audit` must come back clean), then SIGTERM: the supervisor must
exit 0 and no process it started — nor any process that was below it — may still run.
The second uses configured PostgreSQL/NATS and a worker that cannot come back: it is killed
with SIGKILL while the test holds its port, so its restart exits at once; with --max-restarts 1
that second exit stops the stack (exit 1, the reason said), again leaving nothing behind.
Restarts that succeed, and standby coordinators: test_stack_supervision.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import yaml

from shared.child_process import parent_death_signal
from shared.subjects import Subjects
from tests.e2e.coordinator_processes import REPO, clean_env
from tests.integration.test_tls import certs  # noqa: F401 - fixture (certificates made on the fly)

KVLEDGER = [sys.executable, "-m", "kvledger.cli"]
UP_READY = "up; Ctrl-C (or SIGTERM) stops everything"


class UpProcess:
    """``kvledger up`` in its own session, its output collected line by line."""

    def __init__(self, tmp: Path, config: dict[str, Any], *args: str) -> None:
        self.state = tmp / "state"
        # state_dir relative to the working directory, like the default .kvl-state of `make up`
        config = {"state_dir": "state", "logging": {"level": "info"}, **config}
        self.config = tmp / "kvledger.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.lines: list[str] = []
        self.popen = subprocess.Popen(
            [*KVLEDGER, "up", "--config", str(self.config), "--coordinator-port", "0", "--worker-base-port", "0",
             "--gateway-port", "0",
             *args], cwd=tmp, env=clean_env(KVL_TORCH_THREADS="1"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=parent_death_signal())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.popen.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"kvledger up exited ({self.popen.returncode}):\n{self.output()[-6000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} within {timeout_s}s:\n{self.output()[-6000:]}")

    def stack(self) -> dict[str, Any]:
        return json.loads((self.state / "stack.json").read_text())

    def tree(self) -> list[psutil.Process]:
        """Every process below the supervisor right now."""
        return psutil.Process(self.popen.pid).children(recursive=True)

    def kill_all(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


def still_running(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:  # is_running also checks the pid's identity
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def wait_outbox_empty(worker_url: str, timeout_s: float = 30, context: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    depth = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{worker_url}/metrics", timeout=5, context=context) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("kvl_worker_outbox_depth "):
                    depth = float(line.split()[1])
        if depth == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"{worker_url}: outbox depth {depth} after {timeout_s}s")


def kvledger(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVLEDGER, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def ups() -> Iterator[list[UpProcess]]:
    started: list[UpProcess] = []
    yield started
    for up in started:  # whatever happened: nothing of the test's stack survives it
        tree = up.tree() if up.popen.poll() is None else []
        up.kill_all()
        kill_tree(tree)


def kill_tree(tree: list[psutil.Process]) -> None:
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def test_up_two_workers_requests_audit_and_sigterm_leaves_nothing(tmp_path: Path, ups: list[UpProcess]) -> None:
    up = UpProcess(tmp_path, {"worker": {"pool_bytes": 8 * 2**20}, "cache": {"chunk_blocks": 1}}, "--workers", "2")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=240)
    stack = up.stack()
    names = [s["name"] for s in stack["services"]]
    assert names == ["postgres", "nats", "coordinator", "worker-0", "worker-1", "gateway"]
    assert [s["role"] for s in stack["services"][:2]] == ["embedded", "embedded"]
    assert stack["gateway_url"] and f"curl {stack['gateway_url']}/v1/completions" in up.output()
    out = up.output()
    for s in stack["services"]:  # the summary says where everything is
        assert s["url"] in out and str(s["pid"]) in out
    assert "worker-0    |" in out and "coordinator |" in out  # children's logs, prefixed and readable
    assert all(not line.split("| ", 1)[-1].startswith("{") for line in up.lines if " | " in line)
    assert (up.state / "logs" / "worker-1.log").read_text().count('"event"') > 0  # files keep the JSON
    tree = up.tree()
    assert len(tree) >= 5

    # Requests to both workers, with the openai client. The second identical prompt on worker-0
    # is served from its cache once the first one's blocks are committed.
    prompt = "The ledger records every block state change. "  # 45 bytes: two full 16-token blocks
    cached = 0
    for url in stack["worker_urls"]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="kvledger/dsv4-tiny", prompt=prompt, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens == len(prompt.encode()) and r.usage.completion_tokens == 2
        chat = client.chat.completions.create(model="kvledger/dsv4-tiny", max_tokens=1,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].finish_reason == "length"
    client = openai.OpenAI(base_url=f"{stack['worker_urls'][0]}/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(20):
        r = client.completions.create(prompt=prompt, max_tokens=1, model="kvledger/dsv4-tiny")
        cached = r.usage.prompt_tokens_details.cached_tokens
        if cached:
            break
        time.sleep(0.2)
    assert cached == 32
    # The stack's one endpoint: the gateway sends a prompt where it is cached. The prompt above is
    # on both workers (a tie the gateway may break either way), so this one goes to worker-1 only.
    only_one = "Every replica is validated before a kernel reads it. "  # 53 bytes: three full blocks
    direct = openai.OpenAI(base_url=f"{stack['worker_urls'][1]}/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(20):
        if direct.completions.create(prompt=only_one, max_tokens=1, model="kvledger/dsv4-tiny") \
                .usage.prompt_tokens_details.cached_tokens:
            break
        time.sleep(0.2)
    gw = openai.OpenAI(base_url=f"{stack['gateway_url']}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = gw.completions.with_raw_response.create(prompt=only_one, max_tokens=1, model="kvledger/dsv4-tiny")
    assert raw.headers["x-kvl-worker"] == "worker-1" and raw.parse().usage.prompt_tokens_details.cached_tokens == 48

    # The admin commands against the live coordinator, once every transition is committed
    # (a worker's outbox is empty when the coordinator's watermark covers all it sent).
    for worker_url in stack["worker_urls"]:
        wait_outbox_empty(worker_url)
    url = ["--coordinator-url", stack["coordinator_url"]]
    workers = kvledger("workers", *url, "--json")
    assert workers.returncode == 0, workers.stderr
    assert sorted(w["worker_id"] for w in json.loads(workers.stdout)["workers"] if w["alive"]) == \
        ["worker-0", "worker-1"]
    audit = kvledger("audit", *url)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "CLEAN" in audit.stdout and "worker-0, worker-1" in audit.stdout
    # the fleet-wide switch: reuse off (durable in the log), then back on
    off = kvledger("cache", "disable", *url, "--reason", "rollback drill")
    assert off.returncode == 0 and "reuse: off" in off.stdout and "rollback drill" in off.stdout, off.stdout + off.stderr
    r = client.completions.create(prompt=prompt, max_tokens=1, model="kvledger/dsv4-tiny")
    assert r.usage.prompt_tokens_details.cached_tokens == 0      # served by recomputation
    on = kvledger("cache", "enable", *url)
    assert on.returncode == 0 and "reuse: on" in on.stdout, on.stdout + on.stderr
    r = client.completions.create(prompt=prompt, max_tokens=1, model="kvledger/dsv4-tiny")
    assert r.usage.prompt_tokens_details.cached_tokens == 32
    for worker_url in stack["worker_urls"]:
        wait_outbox_empty(worker_url)
    blocks = kvledger("blocks", *url, "--state", "READY", "--json")
    assert blocks.returncode == 0, blocks.stderr
    ready = json.loads(blocks.stdout)["replicas"]
    assert {r["form"] for r in ready} >= {"compressed", "indexer", "swa", "tail"}
    events = kvledger("events", *url, "--limit", "5")
    assert events.returncode == 0 and "events after position 0 (5)" in events.stdout, events.stderr
    database_url = next(s["url"] for s in stack["services"] if s["name"] == "postgres")
    assert ":***@" in database_url   # stack.json never holds the password: it is in its own 0600 file
    password = (up.state / "postgres" / "superuser.password").read_text().strip()
    replay = kvledger("replay", "--database-url", database_url.replace(":***@", f":{password}@"), "--json")
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["ok"] is True

    # SIGTERM: everything stops, in order, and nothing is left.
    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(90) == 0, up.output()[-4000:]
    up._reader.join(5)
    out = up.output()
    assert "none of the 6 processes it started is left" in out, out[-3000:]
    assert still_running(tree) == []
    pids = {s["pid"] for s in stack["services"]}
    leftovers = [p.pid for p in psutil.process_iter() if p.pid in pids and p.status() != psutil.STATUS_ZOMBIE]
    assert leftovers == []
    assert not (up.state / "stack.json").exists()


def test_a_worker_that_keeps_dying_stops_the_stack_and_is_reported(tmp_path: Path, ups: list[UpProcess],
                                                                  database_url: str, nats_url: str,
                                                                  subjects: Subjects) -> None:
    up = UpProcess(tmp_path, {"database": {"url": database_url},
                              "nats": {"url": nats_url, "subject_prefix": subjects.prefix},
                              "worker": {"pool_bytes": 4 * 2**20}}, "--workers", "1", "--quiet", "--max-restarts", "1")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=180)
    stack = up.stack()
    assert [s["role"] for s in stack["services"][:2]] == ["configured", "configured"]
    assert not any(" | " in line for line in up.lines)  # --quiet: logs only in the files
    tree = up.tree()
    worker_pid = next(s["pid"] for s in stack["services"] if s["name"] == "worker-0")
    port = int(stack["worker_urls"][0].rsplit(":", 1)[1])
    os.kill(worker_pid, signal.SIGKILL)
    with socket.socket() as squatter:  # the restarted worker must find its port taken
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 5
        while True:
            try:
                squatter.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, f"port {port} still taken after the kill"
                time.sleep(0.02)
        squatter.listen()
        assert up.popen.wait(90) == 1, up.output()[-4000:]
    up._reader.join(5)
    out = up.output()
    assert f"worker-0 (pid {worker_pid}) exited (code -9); restarting in 0.5s (restart 1)" in out
    assert "worker-0 restarted (pid" in out
    # the restart kept the port (and said so), then exited by itself: no third try
    assert f"kvledger worker: cannot serve HTTP on 127.0.0.1:{port}" in out
    assert "exited (code 2)" in out and "not restarting it: it exited 2 times within 60s (--max-restarts 1); " \
        "stopping the stack" in out
    assert "worker-0 stopped (exit code 2, restarted 1 time(s))" in out
    assert "none of the 4 processes it started is left" in out
    assert still_running(tree) == []
    log = [json.loads(line) for line in (up.state / "logs" / "worker-0.log").read_text().splitlines()
           if line.startswith('{"event": "process_exited"')]
    assert [(e["exit_code"], e["action"]) for e in log] == [(-9, "restarting"), (2, "stopping the stack")]


def test_up_with_tls_serves_https_and_the_admin_commands_verify_it(tmp_path: Path, ups: list[UpProcess],
                                                                   certs: dict[str, str]) -> None:
    """The `tls` section in `kvledger up`'s config: the coordinator's admin API and the worker's
    OpenAI API listen with HTTPS, the supervisor's probes verify them with `tls.ca_file` (the stack
    comes up), a client trusting the CA is served, and `kvledger audit` verifies the coordinator."""
    import httpx2 as httpx   # the HTTP client the openai package uses

    tls = {"cert_file": certs["server"], "key_file": certs["server_key"], "ca_file": certs["ca"]}
    up = UpProcess(tmp_path, {"worker": {"pool_bytes": 8 * 2**20}, "tls": tls}, "--workers", "1")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=240)
    stack = up.stack()
    assert stack["coordinator_url"].startswith("https://") and stack["worker_urls"][0].startswith("https://")
    assert f"curl --cacert {certs['ca']} https://" in up.output()
    with httpx.Client(verify=ssl_context(certs["ca"])) as http:
        client = openai.OpenAI(base_url=f"{stack['worker_urls'][0]}/v1", api_key="unused", max_retries=0,
                               timeout=60, http_client=http)
        r = client.completions.create(model="kvledger/dsv4-tiny", prompt="Hello over TLS", max_tokens=2)
        assert r.usage.completion_tokens == 2
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{stack['worker_urls'][0]}/healthz")      # the system CAs do not know the test CA
    wait_outbox_empty(stack["worker_urls"][0], context=ssl_context(certs["ca"]))
    audit = kvledger("--config", str(up.config), "audit", "--coordinator-url", stack["coordinator_url"])
    assert audit.returncode == 0 and "CLEAN" in audit.stdout, audit.stdout + audit.stderr
    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(90) == 0, up.output()[-4000:]


def ssl_context(ca: str) -> Any:
    import ssl
    return ssl.create_default_context(cafile=ca)
