"""The stack the fault drills break: services and processes this test owns, and ways to talk to them.

:class:`Stack` runs its *own* embedded PostgreSQL and nats-server (:mod:`shared.embedded`) so
that a drill can kill -9 and restart them, a coordinator (``python -m coordinator``) and
workers (``python -m worker``) as subprocesses with logs under the run's directory, and one
shared offload directory. Everything is reached as a user would reach it: the workers'
OpenAI-compatible HTTP API and their NATS debug subjects, the coordinator's admin REST API.

:class:`Observer` is the history's witness: a passive NATS subscriber that records every
transition a worker publishes and every commit watermark the coordinator announces
(:class:`tests.faults.checker.Observed`).

Blocking service calls (starting PostgreSQL takes seconds) run in a thread, so the workload
that shares this event loop keeps going while a fault is injected or healed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import yaml
from prometheus_client.parser import text_string_to_metric_families

from shared import messages as m
from shared import nats_auth
from shared.config import nats_servers
from shared.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from shared.nats_auth import CredentialStore, Identity
from shared.nats_cluster import NatsCluster, embedded_nodes
from shared.subjects import Subjects
from tests.faults.checker import Observed
from tests.worker.processes import Proc
from worker.engine_main import debug_subject, decode_logits
from shared.tenants import key_sha256

REPO = Path(__file__).resolve().parents[2]
PREFIX = "kvlf"
SALT_SECRET = "kvl-fault-drills"
#: The gateway signs the tenant for the workers with it (shared.tenant_header).
GATEWAY_SECRET = "kvl-fault-drills-gateway"
GATEWAY_ID = "gw"
#: coordinator.lease_ttl_ms and resume_grace_ms: short, so that a stall past the grace fits a drill.
LEASE_TTL_MS = 8000
RESUME_GRACE_MS = 15000


def api_key(tenant: str) -> str:
    return f"sk-drill-{tenant}"


def tenant_family(tenant: str) -> list[str]:
    """A drill's tenant and the fresh tenants its churn uses (``<t>-ro-<k>``, ``<t>-rm-<k>``,
    ``<t>-full-<k>``, ``<t>-freed-<k>``, ``<t>-push<k>``): every request names its tenant by an
    API key, so each needs one."""
    return [tenant, *(f"{tenant}-{what}-{k}" for what in ("ro", "rm", "full", "freed") for k in range(6)),
            *(f"{tenant}-push{k}" for k in range(2))]


@dataclass
class WorkerSpec:
    """One worker process: its id and the config sections that differ from the drill default."""

    worker_id: str
    cache: dict[str, Any] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    service: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """One request's outcome, from either channel."""

    channel: str                   # "http" | "debug" | "gateway"
    worker: str
    ok: bool
    seconds: float
    error: str = ""                # kind of failure ("" when ok)
    detail: str = ""
    tokens: list[int] | None = None
    text: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = -1        # as the worker counted them (-1: not reported)
    logits: Any = None
    cached_tokens: int = 0
    degraded: bool = False
    fallbacks: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    reloaded: dict[str, int] = field(default_factory=dict)


class Stack:
    def __init__(self, root: Path, specs: list[WorkerSpec], tenants: list[str], nats_nodes: int = 1) -> None:
        """``nats_nodes``: 1 = one nats-server; 3 or 5 = a JetStream cluster (``shared.nats_cluster``),
        every process given all its servers, the transitions stream at as many replicas."""
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pg = EmbeddedPostgres(root / "postgres", port=free_port())
        self.subjects = Subjects(PREFIX)
        # Every process its own NATS user, as `kvledger up` runs them (shared.nats_auth); "ghost"
        # is a worker identity that exists but never registers (forged-transition drills).
        self.credentials = CredentialStore(root / "nats-credentials")
        conf = self.credentials.write_server_config(
            [*(nats_auth.worker(w) for w in (*(s.worker_id for s in specs), "ghost")), nats_auth.gateway(GATEWAY_ID)],
            self.subjects)
        self.nats: EmbeddedNats | NatsCluster = (
            NatsCluster(root / "nats", nats_nodes, config_file=str(conf)) if nats_nodes > 1
            else EmbeddedNats(root / "nats", port=free_port(), config_file=str(conf)))
        #: Connections as a given user (``client``), e.g. a worker's to replay its forgeries.
        self._clients: dict[str, Any] = {}
        self.admin_port = free_port()
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        #: A second coordinator's admin port (the standby, while a drill runs one).
        self.standby_port = free_port()
        self.standby: Proc | None = None
        self.offload_dir = root / "offload"
        #: The offload directory's own small file system ("" = none could be mounted; why in
        #: ``offload_fs_reason``): what lets a drill fill the disk for real.
        self.offload_fs = ""
        self.offload_fs_reason = ""
        self.specs = {s.worker_id: s for s in specs}
        self.ports = {wid: free_port() for wid in self.specs}
        self.tenants = tenants
        self.coordinator: Proc | None = None
        self.workers: dict[str, Proc] = {}
        #: The fleet's one endpoint (gateway conversations of the drills go through it).
        self.gateway: Proc | None = None
        self.gateway_port = free_port()
        self.http: aiohttp.ClientSession | None = None
        self.nc: Any = None
        #: Set when a drill kills the worker (key: its id) or NATS ("nats"): a debug request in
        #: flight then can never be answered, and fails at once instead of after its timeout.
        self._gone: dict[str, asyncio.Event] = {}
        self.nats_errors = 0
        #: Set while the operator's own NATS link is down (a clustered node it was on was killed): a
        #: debug request in flight then was published through, or waits for a reply routed to, the
        #: node that died; NATS will not deliver that reply, so it fails at once as "nats
        #: disconnected" instead of after its 60 s timeout (seen: 48 s of the cluster drill).
        self._link_down = asyncio.Event()
        self.link_drops = 0

    # --- configuration -----------------------------------------------------------------------

    def _base(self) -> dict[str, Any]:
        return {
            "database": {"url": self.pg.url, "connect_timeout_ms": 1000},
            "nats": {"url": self.nats.url, "subject_prefix": PREFIX, "request_timeout_ms": 1500},
            "coordinator": {"host": "127.0.0.1", "port": self.admin_port, "heartbeat_interval_ms": 200,
                            "missed_heartbeats": 25, "commit_batch_ms": 2, "lease_ttl_ms": LEASE_TTL_MS,
                            "resume_grace_ms": RESUME_GRACE_MS},
            "logging": {"format": "json", "level": "info"},
        }

    def identity(self, ident: Identity) -> dict[str, str]:
        """The ``nats`` config keys that make a process connect as ``ident``."""
        self.credentials.password(ident)
        return {"user": ident.user, "password_file": str(self.credentials.path(ident))}

    def auth(self, ident: Identity) -> dict[str, Any]:
        """``nats.connect`` keyword arguments for ``ident``."""
        return {"user": ident.user, "password": self.credentials.password(ident),
                "inbox_prefix": nats_auth.inbox_prefix(ident.user)}

    async def client(self, ident: Identity) -> Any:
        """A connection as ``ident`` (one per identity, reconnecting forever)."""
        if ident.user not in self._clients:
            async def quiet(e: Exception) -> None:
                self.nats_errors += 1
            self._clients[ident.user] = await nats.connect(
                nats_servers(self.nats.url), name=f"kvl-fault-drills-{ident.user}", max_reconnect_attempts=-1,
                reconnect_time_wait=0.2, allow_reconnect=True, error_cb=quiet, **self.auth(ident))
        return self._clients[ident.user]

    def _write(self, name: str, doc: dict[str, Any]) -> Path:
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
        env["PYTHONPATH"] = str(REPO)
        env["KVL_TORCH_THREADS"] = "1"
        return env

    def worker_config(self, wid: str) -> dict[str, Any]:
        spec = self.specs[wid]
        doc = self._base()
        # NOTE: a bound and small segments, so the disk GC (and its DiskGc requests) runs in every drill
        doc["cache"] = {"chunk_blocks": 1, "offload_dir": str(self.offload_dir), "host_tier_bytes": 0,
                        "offload_dir_bytes": OFFLOAD_DIR_BYTES, "offload_segment_bytes": 2**19,
                        "dtype": os.environ.get("KVL_DRILL_CACHE_DTYPE", "auto"),
                        # always: every hit a dense checkpoint's workers take is read in place (pins held
                        # through every fault); the default as configured otherwise
                        "restore_in_place": os.environ.get("KVL_DRILL_RESTORE_IN_PLACE", "auto"), **spec.cache}
        doc["worker"] = {"worker_id": wid, "host": "127.0.0.1", "port": self.ports[wid], "pool_bytes": 4 * 2**20,
                         "outbox_resend_ms": 500, "debug_subjects": True,
                         "model_dir": os.environ.get("KVL_DRILL_MODEL_DIR", ""), **spec.worker}
        doc["service"] = {"batch_window_ms": 5, **spec.service}
        from tests.faults.workload import drill_bytes_scale
        if (scale := drill_bytes_scale()) != 1.0:
            # a smaller storage precision: the same number of blocks per pool, tier and disk bound
            doc["worker"]["pool_bytes"] = int(doc["worker"]["pool_bytes"] * scale)
            for key in ("host_tier_bytes", "offload_dir_bytes", "offload_segment_bytes"):
                doc["cache"][key] = int(doc["cache"][key] * scale)
        doc["auth"] = self._auth()
        doc["state_dir"] = str(self.root / f"{wid}-state")
        doc["nats"].update(self.identity(nats_auth.worker(wid)))
        return doc

    def _auth(self) -> dict[str, Any]:
        return {"salt_secret": SALT_SECRET, "gateway_secret": GATEWAY_SECRET,
                "keys": [{"key_sha256": key_sha256(api_key(t)), "tenant": t}
                         for t in self.tenants for t in tenant_family(t)]}

    def gateway_config(self) -> dict[str, Any]:
        doc = self._base()
        doc["auth"] = self._auth()
        doc["gateway"] = {"gateway_id": GATEWAY_ID, "host": "127.0.0.1", "port": self.gateway_port,
                          "fleet_refresh_ms": 200, "worker_down_ms": 1000}
        doc["worker"] = {"model_dir": os.environ.get("KVL_DRILL_MODEL_DIR", "")}
        doc["nats"].update(self.identity(nats_auth.gateway(GATEWAY_ID)))
        return doc

    # --- processes ---------------------------------------------------------------------------

    async def start(self, timeout_s: float = 180) -> None:
        self.offload_fs, self.offload_fs_reason = mount_small_fs(self.offload_dir, OFFLOAD_FS_BYTES)
        await asyncio.to_thread(self.pg.start, 60)
        await asyncio.to_thread(self.nats.start, 30)
        self.http = aiohttp.ClientSession()

        async def quiet(e: Exception) -> None:
            self.nats_errors += 1

        async def link_down() -> None:
            self.link_drops += 1
            self._link_down.set()

        async def link_up() -> None:
            self._link_down = asyncio.Event()

        # the operator: the debug subjects (generate with logits, health, metrics, flush)
        self.nc = await nats.connect(nats_servers(self.nats.url), name="kvl-fault-drills", max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.2, allow_reconnect=True, error_cb=quiet,
                                     disconnected_cb=link_down, reconnected_cb=link_up,
                                     **self.auth(Identity("operator")))
        self.start_coordinator()
        for wid in self.specs:
            self.start_worker(wid)
        await self.wait_coordinator(timeout_s)
        await asyncio.gather(*[self.wait_worker(wid, timeout_s) for wid in self.specs])
        self.start_gateway()
        await self.wait_gateway(timeout_s)

    def start_gateway(self) -> Proc:
        assert self.gateway is None or not self.gateway.alive, "the gateway is running"
        cfg = self._write("gateway", self.gateway_config())
        self.gateway = Proc("gateway", [sys.executable, "-m", "gateway", "--config", str(cfg)],
                            self.logs / "gateway.log", self._env())
        return self.gateway

    async def wait_gateway(self, timeout_s: float = 120) -> None:
        """Until the gateway's ``/readyz`` lists every worker usable."""
        deadline = time.monotonic() + timeout_s
        body: Any = None
        while time.monotonic() < deadline:
            assert self.gateway is not None and self.gateway.alive, f"the gateway exited\n{self.gateway.tail()}"
            status, body = await self._get(f"http://127.0.0.1:{self.gateway_port}/readyz", 2.0)
            if status == 200 and body.get("usable") == len(self.specs):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"gateway not ready in {timeout_s:.0f}s: {body}\n{self.gateway.tail()}")

    def _coordinator_proc(self, name: str, port: int) -> Proc:
        doc = self._base()
        doc["coordinator"]["port"] = port
        doc["state_dir"] = str(self.root / f"{name}-state")
        doc["nats"].update(self.identity(Identity("coordinator")))
        cfg = self._write(name, doc)
        return Proc(name, [sys.executable, "-m", "coordinator", "--config", str(cfg)], self.logs / f"{name}.log",
                    self._env())

    def start_coordinator(self) -> Proc:
        assert self.coordinator is None or not self.coordinator.alive, "the coordinator is running"
        self.coordinator = self._coordinator_proc("coordinator", self.admin_port)
        return self.coordinator

    def kill_coordinator(self) -> None:
        assert self.coordinator is not None
        self.coordinator.kill(signal.SIGKILL)

    def signal_coordinator(self, sig: int) -> None:
        """SIGSTOP / SIGCONT the leader (returns at once)."""
        assert self.coordinator is not None
        self.coordinator.signal(sig)

    def start_standby(self) -> Proc:
        """A second coordinator on the same database and NATS: it waits for the lock, following the log."""
        assert self.standby is None or not self.standby.alive, "a standby is running"
        self.standby = self._coordinator_proc("standby", self.standby_port)
        return self.standby

    async def standby_status(self) -> tuple[int, Any]:
        return await self._get(f"http://127.0.0.1:{self.standby_port}/readyz", 2.0)

    def promote_standby(self) -> None:
        """The standby leads now: it becomes *the* coordinator (admin API included); the old
        coordinator's port is the next standby's."""
        assert self.standby is not None
        old = self.coordinator
        self.coordinator, self.standby = self.standby, None
        self.admin_port, self.standby_port = self.standby_port, self.admin_port
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        if old is not None:
            old.kill(signal.SIGKILL)

    def start_worker(self, wid: str, *, failpoints: str = "", service: dict[str, Any] | None = None) -> Proc:
        """``failpoints``: the process's ``KVL_FAILPOINTS`` (:mod:`worker.failpoints`); ``service``:
        keys over the spec's. Both for this process only: a restart without them is ordinary."""
        old = self.workers.get(wid)
        assert old is None or not old.alive, f"{wid} is running"
        doc = self.worker_config(wid)
        doc["service"].update(service or {})
        cfg = self._write(wid, doc)
        env = self._env()
        if failpoints:
            env["KVL_FAILPOINTS"] = failpoints
        self._gone.pop(wid, None)
        self.workers[wid] = Proc(wid, [sys.executable, "-m", "worker", "--config", str(cfg)],
                                 self.logs / f"{wid}.log", env)
        return self.workers[wid]

    def kill_worker(self, wid: str) -> None:
        self.workers[wid].kill(signal.SIGKILL)
        self.gone(wid).set()

    async def kill_nats(self) -> None:
        await asyncio.to_thread(self.nats.kill)
        self.gone("nats").set()

    async def start_nats(self) -> None:
        await asyncio.to_thread(self.nats.start, 30)
        self._gone.pop("nats", None)

    async def kill_nats_node(self, i: int) -> None:
        """kill -9 node ``i`` of the NATS cluster (the others carry the bus and the stream on)."""
        assert isinstance(self.nats, NatsCluster)
        await asyncio.to_thread(self.nats.nodes[i].kill)

    async def start_nats_node(self, i: int) -> None:
        """Node ``i`` again, on its ports and from its store: it rejoins the cluster."""
        assert isinstance(self.nats, NatsCluster)
        await asyncio.to_thread(self.nats.nodes[i].start, 30)

    def gone(self, what: str) -> asyncio.Event:
        return self._gone.setdefault(what, asyncio.Event())

    async def kill_postgres(self) -> None:
        await asyncio.to_thread(self.pg.kill)

    async def stop_postgres(self) -> None:
        await asyncio.to_thread(self.pg.stop)

    async def start_postgres(self) -> None:
        await asyncio.to_thread(self.pg.start, 60)

    async def heal(self, timeout_s: float = 120) -> list[str]:
        """Restart whatever is down (a drill that failed half-way); returns what was restarted."""
        done = []
        if self.pg.proc is None or self.pg.proc.poll() is not None:
            self.pg.proc = None
            await self.start_postgres()
            done.append("postgres")
        for name, node in embedded_nodes(self.nats):
            if node.proc is None or node.proc.poll() is not None:
                node.proc = None
                await asyncio.to_thread(node.start, 30)
                self._gone.pop("nats", None)
                done.append(name)
        if self.coordinator is not None:
            self.coordinator.signal(signal.SIGCONT)   # a drill that failed while it was stopped
        if self.coordinator is None or not self.coordinator.alive:
            self.start_coordinator()
            done.append("coordinator")
        if self.standby is not None:
            self.standby.kill(signal.SIGKILL)
            self.standby = None
        for wid in self.specs:
            if not self.workers[wid].alive:
                self.start_worker(wid)
                done.append(wid)
        if self.gateway is None or not self.gateway.alive:
            self.start_gateway()
            done.append("gateway")
        await self.wait_coordinator(timeout_s)
        await asyncio.gather(*[self.wait_worker(wid, timeout_s) for wid in self.specs])
        await self.wait_gateway(timeout_s)
        return done

    async def stop(self) -> None:
        for nc in (self.nc, *self._clients.values()):
            if nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.close(), 5)
        if self.http is not None:
            await self.http.close()
        procs = [p for p in (self.gateway, *self.workers.values(), self.coordinator, self.standby) if p is not None]
        await asyncio.gather(*[asyncio.to_thread(p.stop) for p in procs], return_exceptions=True)
        for p in procs:
            p.kill()
        await asyncio.to_thread(self.nats.stop)
        await asyncio.to_thread(self.pg.stop)
        if self.offload_fs:
            make_writable(self.offload_dir)
            subprocess.run(["umount", "-l", str(self.offload_dir)], capture_output=True)

    def log_tails(self, n: int = 25) -> str:
        procs = [p for p in (self.coordinator, self.standby, *self.workers.values(), self.gateway) if p is not None]
        return "\n".join(f"--- {p.name} ({'alive' if p.alive else 'dead'}) ---\n{p.tail(n)}" for p in procs)

    # --- readiness -----------------------------------------------------------------------------

    async def _get(self, url: str, timeout_s: float = 3.0) -> tuple[int, Any]:
        assert self.http is not None
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return 0, repr(e)

    async def coordinator_ready(self) -> bool:
        status, _ = await self._get(f"{self.admin}/readyz", 2.0)
        return status == 200

    async def wait_coordinator(self, timeout_s: float = 120) -> float:
        t0 = time.monotonic()
        last: Any = None
        while time.monotonic() - t0 < timeout_s:
            assert self.coordinator is not None
            if not self.coordinator.alive:
                raise AssertionError(f"coordinator exited\n{self.log_tails()}")
            status, last = await self._get(f"{self.admin}/readyz", 2.0)
            if status == 200:
                return time.monotonic() - t0
            await asyncio.sleep(0.1)
        raise AssertionError(f"coordinator not ready in {timeout_s:.0f}s (last /readyz: {last})\n{self.log_tails()}")

    async def worker_readyz(self, wid: str) -> tuple[int, Any]:
        return await self._get(f"http://127.0.0.1:{self.ports[wid]}/readyz", 2.0)

    async def wait_worker(self, wid: str, timeout_s: float = 120, *, epoch_above: int = 0) -> dict[str, Any]:
        """Until the worker is ready with the coordinator reachable (registered, not degraded)."""
        t0 = time.monotonic()
        last: Any = None
        while time.monotonic() - t0 < timeout_s:
            if not self.workers[wid].alive:
                raise AssertionError(f"{wid} exited\n{self.log_tails()}")
            status, last = await self.worker_readyz(wid)
            if status == 200 and isinstance(last, dict) and last.get("status") == "ready" \
                    and last.get("epoch", 0) > epoch_above:
                return last
            await asyncio.sleep(0.1)
        raise AssertionError(f"{wid} not ready in {timeout_s:.0f}s (last /readyz: {last})\n{self.log_tails()}")

    # --- admin API -----------------------------------------------------------------------------

    async def admin_get(self, path: str, timeout_s: float = 30) -> Any:
        assert self.http is not None
        async with self.http.get(self.admin + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            body = await r.json(content_type=None)
            assert r.status == 200, f"GET {path}: {r.status} {body}"
            return body

    async def admin_post(self, path: str, body: Any = None, timeout_s: float = 120) -> Any:
        assert self.http is not None
        async with self.http.post(self.admin + path, json=body or {},
                                  timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            out = await r.json(content_type=None)
            assert r.status == 200, f"POST {path}: {r.status} {out}"
            return out

    async def events(self) -> list[dict[str, Any]]:
        """The whole event log, paged through ``GET /v1/events``."""
        out: list[dict[str, Any]] = []
        after = 0
        while True:
            page = await self.admin_get(f"/v1/events?after={after}&limit=1000")
            out.extend(page["events"])
            if not page["events"]:
                return out
            after = page["next_after"]

    async def replicas(self, **filters: str) -> list[dict[str, Any]]:
        q = "&".join(f"{k}={v}" for k, v in filters.items())
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = await self.admin_get(f"/v1/blocks?limit=1000&{q}" + (f"&cursor={cursor}" if cursor else ""))
            out += page["replicas"]
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    # --- workers -------------------------------------------------------------------------------

    async def metrics(self, wid: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The worker's Prometheus samples: ``{(name, sorted labels): value}``."""
        assert self.http is not None
        async with self.http.get(f"http://127.0.0.1:{self.ports[wid]}/metrics",
                                 timeout=aiohttp.ClientTimeout(total=10)) as r:
            text = await r.text()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    async def metric(self, wid: str, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        samples = await self.metrics(wid)
        want = set(labels.items())
        return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))

    async def debug(self, wid: str, what: str, payload: dict[str, Any] | None = None, timeout_s: float = 30) -> Any:
        msg = await self.nc.request(debug_subject(self.subjects, wid, what), json.dumps(payload or {}).encode(),
                                    timeout=timeout_s)
        out = json.loads(msg.data) if what != "metrics" else msg.data.decode()
        if isinstance(out, dict) and "error" in out:
            raise RuntimeError(f"{wid} {what}: {out['error']}")
        return out

    async def flush(self, wid: str, timeout_s: float = 20) -> bool:
        return bool((await self.debug(wid, "flush", {"timeout_s": timeout_s}, timeout_s + 5))["flushed"])

    async def http_generate(self, wid: str, tokens: list[int], max_tokens: int, tenant: str, *,
                            reuse: bool = True, timeout_s: float = 90) -> Reply:
        """``POST /v1/completions`` on worker ``wid`` with token ids as the prompt, greedy."""
        return await self._completion("http", f"http://127.0.0.1:{self.ports[wid]}", wid, tokens, max_tokens, tenant,
                                      reuse=reuse, timeout_s=timeout_s)

    async def gateway_generate(self, tokens: list[int], max_tokens: int, tenant: str, *,
                               timeout_s: float = 90, n: int = 1) -> Reply:
        """The same through the gateway; the reply names the worker that served it (``gateway``
        when none did). ``n`` > 1: that many greedy samples of one prefill (forked), which must
        all be the same answer (the reply's text is theirs, or all of them when they differ)."""
        return await self._completion("gateway", f"http://127.0.0.1:{self.gateway_port}", "gateway", tokens,
                                      max_tokens, tenant, timeout_s=timeout_s, n=n)

    async def _completion(self, channel: str, base: str, wid: str, tokens: list[int], max_tokens: int, tenant: str,
                          *, reuse: bool = True, timeout_s: float = 90, n: int = 1) -> Reply:
        assert self.http is not None
        body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "cache_reuse": reuse, "n": n}
        headers = {"Authorization": f"Bearer {api_key(tenant)}"}
        t0 = time.monotonic()
        try:
            async with self.http.post(base + "/v1/completions", json=body, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                raw = await r.text()
                status = r.status
                wid = r.headers.get("x-kvl-worker", wid)
        except aiohttp.ClientConnectorError as e:
            return Reply(channel, wid, False, time.monotonic() - t0, "connection refused", str(e))
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as e:
            return Reply(channel, wid, False, time.monotonic() - t0, "connection reset", repr(e))
        except asyncio.TimeoutError:
            return Reply(channel, wid, False, time.monotonic() - t0, "client timeout", f"no answer in {timeout_s}s")
        dt = time.monotonic() - t0
        try:
            doc = json.loads(raw)
        except ValueError:
            return Reply(channel, wid, False, dt, f"http {status} (not JSON)", raw[:300])
        if status != 200:
            err = doc.get("error", {}) if isinstance(doc, dict) else {}
            return Reply(channel, wid, False, dt, f"http {status} {err.get('code') or ''}".strip(),
                         str(err.get("message", doc))[:300])
        usage = doc.get("usage", {})
        kvl = doc.get("kvl", {})
        texts = list(dict.fromkeys(ch["text"] for ch in doc["choices"]))
        return Reply(channel, wid, True, dt, text=" | ".join(texts) if len(doc["choices"]) == n else
                     f"{len(doc['choices'])} choices for n={n}",
                     completion_tokens=usage.get("completion_tokens", -n) // n, prompt_tokens=usage.get("prompt_tokens", -1),
                     cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                     degraded=bool(kvl.get("degraded")), fallbacks=list(kvl.get("fallbacks") or []))

    async def debug_generate(self, wid: str, tokens: list[int], max_tokens: int, tenant: str, *,
                             reuse: bool = True, timeout_s: float = 60) -> Reply:
        """The worker's NATS debug subject: token ids and logits (bit-exact comparison)."""
        payload = {"tokens": tokens, "max_tokens": max_tokens, "api_key": api_key(tenant), "reuse": reuse,
                   "return_logits": True}
        t0 = time.monotonic()
        request = asyncio.ensure_future(self.nc.request(debug_subject(self.subjects, wid, "generate"),
                                                        json.dumps(payload).encode(), timeout=timeout_s))
        link = asyncio.ensure_future(self._link_down.wait())
        waits = {request, link, *(asyncio.ensure_future(self.gone(w).wait()) for w in (wid, "nats"))}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits - {request}:
                w.cancel()
        if not request.done():
            request.cancel()
            if link.done() and not link.cancelled() and not self.gone("nats").is_set() and not self.gone(wid).is_set():
                return Reply("debug", wid, False, time.monotonic() - t0, "nats disconnected",
                             "the drill's own NATS link dropped with this request in flight: its reply is lost")
            what = "NATS" if self.gone("nats").is_set() else wid
            return Reply("debug", wid, False, time.monotonic() - t0, "killed mid-request",
                         f"{what} was killed with this request in flight")
        try:
            msg = request.result()
            out = json.loads(msg.data)
        except nats.errors.NoRespondersError:
            return Reply("debug", wid, False, time.monotonic() - t0, "nats no responders", wid)
        except nats.errors.TimeoutError:
            return Reply("debug", wid, False, time.monotonic() - t0, "nats timeout", f"no answer in {timeout_s}s")
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                nats.errors.OutboundBufferLimitError, nats.errors.StaleConnectionError) as e:
            return Reply("debug", wid, False, time.monotonic() - t0, "nats disconnected", repr(e))
        dt = time.monotonic() - t0
        if "error" in out:
            return Reply("debug", wid, False, dt, "worker error", str(out["error"])[:300])
        return Reply("debug", wid, True, dt, tokens=out["tokens"], logits=decode_logits(out),
                     completion_tokens=len(out["tokens"]), prompt_tokens=out["prompt_tokens"],
                     cached_tokens=out["cached_tokens"],
                     degraded=out["degraded"], fallbacks=out["fallbacks"], invalid=out["invalid"],
                     reloaded=out["reloaded"])


class Observer:
    """Records what the workers publish and what the coordinator acknowledges (see checker)."""

    def __init__(self, url: str, subjects: Subjects, auth: dict[str, Any] | None = None) -> None:
        self.url = url
        self.subjects = subjects
        #: ``nats.connect`` credentials: the read-only ``observer`` user.
        self.auth = dict(auth or {})
        self.seen = Observed()
        self.nc: Any = None
        self.disconnects = 0
        self.errors = 0
        self.undecodable = 0

    async def start(self) -> None:
        async def gone() -> None:
            self.disconnects += 1

        async def quiet(e: Exception) -> None:
            self.errors += 1

        self.nc = await nats.connect(nats_servers(self.url), name="kvl-fault-observer", max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.1, allow_reconnect=True, disconnected_cb=gone,
                                     error_cb=quiet, pending_size=64 * 2**20, **self.auth)
        await self.nc.subscribe(self.subjects.events_wildcard, cb=self._transition, pending_msgs_limit=-1,
                                pending_bytes_limit=-1)
        await self.nc.subscribe(f"{self.subjects.prefix}.worker.*.watermark", cb=self._watermark,
                                pending_msgs_limit=-1, pending_bytes_limit=-1)
        await self.nc.flush()

    async def _transition(self, msg: Any) -> None:
        try:
            data = json.loads(msg.data)
            # a worker's batch (``transitions``) carries its transitions in order
            for t in data["events"] if data.get("type") == "transitions" else [data]:
                self.seen.on_transition(t)
        except (ValueError, KeyError, TypeError, AttributeError):
            self.undecodable += 1

    async def _watermark(self, msg: Any) -> None:
        try:
            wm = m.decode(msg.data, expect=m.CommitWatermark)
        except m.MessageError:
            self.undecodable += 1
            return
        self.seen.on_watermark(wm.worker_id, wm.epoch, wm.seq)

    async def settle(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=5)
        await asyncio.sleep(0.5)

    async def stop(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 5)


# --- file-system faults --------------------------------------------------------------------------

#: The offload directory's file system (a tmpfs of its own where this process may mount one), and
#: what each drill worker may keep there: small, so the disk GC deletes segments (after DiskGc
#: evictions) in the drills, and two offloading workers stay well inside the file system.
OFFLOAD_FS_BYTES = 256 * 2**20
OFFLOAD_DIR_BYTES = 3 * 2**20


def mount_small_fs(path: Path, nbytes: int) -> tuple[str, str]:
    """Mount a tmpfs of ``nbytes`` at ``path`` (root only): ``(what, "")``, or ``("", why not)``."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "", "not root (mounting a small file system needs CAP_SYS_ADMIN)"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return "", f"mount -t tmpfs failed: {r.stderr.strip()[:200]}"
    return f"tmpfs of {nbytes // 2**20} MiB", ""


def fill_fs(path: Path, at_most: int) -> tuple[Path, int]:
    """Write a filler file under ``path`` until its file system is full (ENOSPC); returns it and
    its size. Refuses (RuntimeError) a file system larger than ``at_most`` bytes: filling the
    machine's own disk would take down every service on it (PostgreSQL first)."""
    st = os.statvfs(path)
    if st.f_blocks * st.f_frsize > at_most:
        raise RuntimeError(f"refusing to fill {path}: its file system holds {st.f_blocks * st.f_frsize:,} bytes, "
                           f"more than the {at_most:,} of a drill's own (was its small file system unmounted?)")
    filler = path / "filler"
    chunk = b"\0" * 2**20
    n = 0
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return filler, n


#: Directories :func:`make_read_only` bind-mounted read-only over themselves: the only mounts
#: :func:`make_writable` takes away (the offload directory is a mount point of its own, a tmpfs).
_READ_ONLY_BINDS: set[Path] = set()


def make_read_only(path: Path) -> str:
    """Make a directory tree unwritable, also for root; returns how (for the report).

    As a normal user, permissions do it. Root ignores permissions, so the tree is made
    immutable (``chattr +i``, which tmpfs supports on recent kernels), or, where the file system
    has no such flag, the directory is bind-mounted read-only over itself.
    """
    if os.geteuid() != 0:
        for d in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
            d.chmod(0o500)
        return "chmod a-w"
    tried = []
    chattr = shutil.which("chattr")
    if chattr is not None:
        r = subprocess.run([chattr, "-R", "+i", str(path)], capture_output=True, text=True)
        if r.returncode == 0:
            return "chattr +i (root)"
        subprocess.run([chattr, "-R", "-i", str(path)], capture_output=True)
        tried.append(f"chattr +i: {r.stderr.strip()}")
    for argv in (["mount", "--bind", str(path), str(path)], ["mount", "-o", "remount,ro,bind", str(path)]):
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            if argv[1] != "--bind":
                subprocess.run(["umount", str(path)], capture_output=True)
            tried.append(f"{' '.join(argv[:3])}: {r.stderr.strip()}")
            raise RuntimeError(f"cannot make {path} read-only as root: {'; '.join(tried)}")
        if argv[1] == "--bind":
            _READ_ONLY_BINDS.add(path)
    return "read-only bind mount (root)"


def make_writable(path: Path) -> None:
    if not path.exists():
        return
    if os.geteuid() != 0:
        for d in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
            d.chmod(0o700)
        return
    # NOTE: only the bind mount make_read_only made: "is a mount point" was also true of the
    # tmpfs under it, and unmounting that put the offload directory on the machine's disk (the
    # next offload-full drill then filled the disk PostgreSQL lives on: a soak found it).
    if path in _READ_ONLY_BINDS:
        subprocess.run(["umount", str(path)], capture_output=True)
        _READ_ONLY_BINDS.discard(path)
    chattr = shutil.which("chattr")
    if chattr is not None:
        subprocess.run([chattr, "-R", "-i", str(path)], capture_output=True)


