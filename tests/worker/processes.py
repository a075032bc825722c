"""Run the real coordinator and worker processes for end-to-end tests, and talk to them.

:class:`Cluster` writes a YAML config per process, starts ``python -m coordinator`` and
``python -m worker`` as subprocesses (output to log files under the test's tmp dir), and
kills every process it started when the test ends, whatever happened. Requests go through
the worker's NATS debug subjects (``worker.engine_main``); the ledger is read through the
coordinator's admin REST API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import yaml

from shared.child_process import parent_death_signal
from shared.embedded import free_port
from shared.subjects import Subjects
from worker.engine_main import debug_subject, decode_logits

REPO = Path(__file__).resolve().parents[2]


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        self._f = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._f, stderr=subprocess.STDOUT,
                                      start_new_session=True, preexec_fn=parent_death_signal())

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
        if self.alive:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(wait)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

    def signal(self, sig: int) -> None:
        """Send ``sig`` and return at once (SIGSTOP, SIGCONT)."""
        if self.alive:
            self.popen.send_signal(sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)   # a stopped process cannot act on SIGTERM
        self.kill(signal.SIGTERM, wait=8.0)
        self._f.close()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Cluster:
    def __init__(self, tmp: Path, database_url: str, nats_url: str, subjects: Subjects) -> None:
        self.tmp = tmp
        self.database_url = database_url
        self.nats_url = nats_url
        self.subjects = subjects
        self.offload_dir = tmp / "offload"
        self.procs: list[Proc] = []
        self.coordinator: Proc | None = None
        self.admin_port = free_port()
        self.workers: dict[str, Proc] = {}
        self.nc: Any = None

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
        env["PYTHONPATH"] = str(REPO)
        env["KVL_TORCH_THREADS"] = "1"
        return env

    def _write(self, name: str, doc: dict[str, Any]) -> Path:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    def base(self) -> dict[str, Any]:
        return {
            "database": {"url": self.database_url, "connect_timeout_ms": 2000},
            "nats": {"url": self.nats_url, "subject_prefix": self.subjects.prefix, "request_timeout_ms": 1500},
            "coordinator": {"heartbeat_interval_ms": 200, "missed_heartbeats": 25, "commit_batch_ms": 2,
                            "port": self.admin_port},
            "logging": {"format": "json", "level": "info"},
        }

    # --- processes ----------------------------------------------------------------------------

    def start_coordinator(self) -> Proc:
        doc = self.base()
        doc["state_dir"] = str(self.tmp / "coordinator-state")
        cfg = self._write("coordinator", doc)
        p = Proc("coordinator", [sys.executable, "-m", "coordinator", "--config", str(cfg)],
                 self.tmp / "coordinator.log", self._env())
        self.procs.append(p)
        self.coordinator = p
        return p

    def stop_coordinator(self, sig: int = signal.SIGTERM) -> None:
        assert self.coordinator is not None
        self.coordinator.kill(sig)

    def start_worker(self, worker_id: str, cache: dict[str, Any] | None = None,
                     worker: dict[str, Any] | None = None, service: dict[str, Any] | None = None,
                     failpoints: str = "") -> Proc:
        """``failpoints``: ``KVL_FAILPOINTS`` of the process (:mod:`worker.failpoints`)."""
        doc = self.base()
        doc["cache"] = {"chunk_blocks": 1, "offload_dir": str(self.offload_dir), "host_tier_bytes": 4 * 2**20,
                        **(cache or {})}
        doc["worker"] = {"worker_id": worker_id, "pool_bytes": 4 * 2**20, "outbox_resend_ms": 500,
                         "port": free_port(), "debug_subjects": True, **(worker or {})}
        if service:
            doc["service"] = {**doc.get("service", {}), **service}
        doc["state_dir"] = str(self.tmp / f"{worker_id}-state")
        cfg = self._write(worker_id, doc)
        env = self._env()
        if failpoints:
            env["KVL_FAILPOINTS"] = failpoints
        p = Proc(worker_id, [sys.executable, "-m", "worker", "--config", str(cfg)],
                 self.tmp / f"{worker_id}.log", env)
        self.procs.append(p)
        self.workers[worker_id] = p
        return p

    def stop_all(self, grace: float = 5.0) -> None:
        """SIGTERM every live process at once, SIGKILL what is left after ``grace`` seconds."""
        for p in self.procs:
            if p.alive:
                try:
                    p.popen.send_signal(signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
            finally:
                p._f.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.tail()}" for p in self.procs)

    # --- talking to them ----------------------------------------------------------------------

    async def connect(self) -> None:
        self.nc = await nats.connect(self.nats_url)

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.drain()

    async def wait_coordinator(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.admin_port}/readyz"
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                assert self.coordinator is not None and self.coordinator.alive, self.logs()
                try:
                    async with http.get(url) as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise AssertionError(f"coordinator not ready in {timeout}s\n{self.logs()}")

    async def debug(self, worker_id: str, what: str, payload: dict[str, Any] | None = None,
                    timeout: float = 60) -> Any:
        msg = await self.nc.request(debug_subject(self.subjects, worker_id, what),
                                    json.dumps(payload or {}).encode(), timeout=timeout)
        if what == "metrics":
            return msg.data.decode()
        out = json.loads(msg.data)
        if isinstance(out, dict) and "error" in out:
            raise AssertionError(f"{worker_id} {what}: {out['error']}")
        return out

    async def health(self, worker_id: str) -> dict[str, Any] | None:
        try:
            return await self.debug(worker_id, "health", timeout=2)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return None

    async def wait_worker(self, worker_id: str, *, registered: bool = True, epoch_above: int = 0,
                          timeout: float = 60, contact: str = "") -> dict[str, Any]:
        """Until the worker's health matches (``contact``: e.g. ``reachable``; "" = any)."""
        deadline = time.monotonic() + timeout
        h = None
        while time.monotonic() < deadline:
            proc = self.workers[worker_id]
            assert proc.alive, f"{worker_id} exited\n{self.logs()}"
            h = await self.health(worker_id)
            if (h is not None and h["registered"] == registered and (not registered or h["epoch"] > epoch_above)
                    and (not contact or h.get("contact") == contact)):
                return h
            await asyncio.sleep(0.1)
        raise AssertionError(f"{worker_id} not in the wanted state in {timeout}s: {h}\n{self.logs()}")

    async def generate(self, worker_id: str, tokens: list[int], max_tokens: int = 2, **kw: Any) -> dict[str, Any]:
        out = await self.debug(worker_id, "generate", {"tokens": tokens, "max_tokens": max_tokens, **kw})
        out["logits"] = decode_logits(out)
        return out

    async def flush(self, worker_id: str, timeout_s: float = 10) -> bool:
        return (await self.debug(worker_id, "flush", {"timeout_s": timeout_s}, timeout=timeout_s + 5))["flushed"]

    async def http_url(self, worker_id: str, timeout: float = 60) -> str:
        """The address the worker printed (``listening on http://…``; started with ``worker.port`` 0)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.workers[worker_id]
            assert proc.alive, self.logs()
            m = re.search(r"^listening on (http://\S+)$", proc.log.read_text(errors="replace"), re.M)
            if m:
                return m.group(1)
            await asyncio.sleep(0.1)
        raise AssertionError(f"{worker_id} printed no HTTP address\n{self.logs()}")

    async def admin(self, path: str) -> Any:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{self.admin_port}{path}") as r:
                assert r.status == 200, await r.text()
                return await r.json()

    async def audit(self) -> dict[str, Any]:
        """The coordinator's audit report: the log replayed from empty, every worker's inventory checked."""
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{self.admin_port}/v1/audit",
                                 json={"replay_from": "empty", "check_workers": True}) as r:
                assert r.status == 200, await r.text()
                return await r.json()

    async def replicas(self, **filters: str) -> list[dict[str, Any]]:
        q = "&".join(f"{k}={v}" for k, v in filters.items())
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = await self.admin(f"/v1/blocks?limit=1000&{q}" + (f"&cursor={cursor}" if cursor else ""))
            out += page["replicas"]
            cursor = page.get("next_cursor")
            if not cursor:
                return out


@contextlib.asynccontextmanager
async def running_cluster(tmp: Path, database_url: str, nats_url: str, subjects: Subjects, *,
                          auth: dict[str, Any] | None = None) -> AsyncIterator[Cluster]:
    """A connected :class:`Cluster` (``auth``: the section every process's config gets); afterwards
    every process it started is stopped and its NATS connection drained, whatever the test did."""
    c = Cluster(tmp, database_url, nats_url, subjects)
    if auth is not None:
        base = c.base
        c.base = lambda: {**base(), "auth": auth}    # type: ignore[method-assign]
    await c.connect()
    try:
        yield c
    finally:
        c.stop_all()
        await c.close()
