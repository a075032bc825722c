"""What every phase of ``bench.coordinator`` stands on: the shared constants, scratch databases,
the coordinator as its own process (:class:`CoordinatorProc`), the echo responder that is the
lease baseline (:class:`EchoProc`), the concurrent request driver (:func:`drive`), and the readings
of appends and CPU time that turn into per-operation figures. Also used by ``bench.host_evict``,
``bench.lease_ab``, ``bench.snapshot`` and ``bench.archive``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from bench.proc_cpu import cpu_spent, stack_cpu


REPO = Path(__file__).resolve().parents[2]
NS = "ab" * 16
WORKER = "benchw"
BLOCK = 16
#: Blocks per write lease while setting up the ingest (one lease = one append of 1 + k events).
SETUP_LEASE_BLOCKS = 500
#: Lease prompts: 16 blocks, the first 12 cached.
PROMPT_BLOCKS, CACHED_BLOCKS = 16, 12
#: Lease TTL the bench asks for (and configures): leases stay live until the release phase.
LEASE_TTL_MS = 600_000
#: The phases, in the order they run (``--only``); replay includes the restart and the takeover.
PHASES = ("ingest", "leases", "idle", "replay")
COLUMNS = ["position", "stream_id", "stream_version", "source_id", "type", "payload", "leader_epoch", "chain_hash"]


def log(msg: str) -> None:
    print(f"[bench.coordinator {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def h(i: int) -> str:
    return f"{i:032x}"


def catalogue() -> Any:
    from shared.forms import FormCatalogue, FormScope, FormSpec
    return FormCatalogue(model_id="bench", block_size=BLOCK, forms=(
        FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=512, dtype="bfloat16"),))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# --- services, databases, processes ----------------------------------------------------------

def _plain(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def create_db(url: str, tag: str) -> tuple[str, str]:
    import asyncpg
    name = f"kvl_bench_{tag}_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(_plain(url))
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return _plain(url).rpartition("/")[0] + "/" + name, name


async def drop_db(url: str, name: str) -> None:
    import asyncpg
    conn = await asyncpg.connect(_plain(url))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def scratch_database(url: str, tag: str, tmp: Path) -> AsyncIterator[str]:
    """A fresh database on ``url``'s server, or on an embedded PostgreSQL (under ``tmp``) when
    ``url`` is empty; dropped (and the embedded server stopped) afterwards."""
    from shared.embedded import start_services

    services = None
    name = ""
    try:
        if not url:
            services = await asyncio.to_thread(start_services, "", "nats://unused", str(tmp / "services"))
            url = services.database_url
        db, name = await create_db(url, tag)
        yield db
    finally:
        if name:
            await drop_db(url, name)
        if services is not None:
            await asyncio.to_thread(services.stop)


class CoordinatorProc:
    """``python -m coordinator --config <file>`` with its log in a file; always stopped by the bench."""

    def __init__(self, tmp: Path, name: str, database_url: str, nats_url: str, prefix: str,
                 coordinator: dict[str, Any] | None = None, repo: Path = REPO,
                 database: dict[str, Any] | None = None) -> None:
        import yaml

        from shared.embedded import free_port
        self.name = name
        #: The checkout whose coordinator runs (``bench.lease_ab`` runs two builds side by side).
        self.repo = repo
        self.port = free_port()
        self.config = tmp / f"{name}.yaml"
        self.logfile = tmp / f"{name}.log"
        # Production defaults except: a worker is suspended after 20 missed heartbeats (not 5)
        # and leases live 10 minutes (not 30 s; the bench holds thousands of them until its
        # release phase), so a saturated 2-core machine cannot expire them mid-run; the resume
        # grace is as long as the lease TTL (the config requires at least that). ``coordinator``
        # overrides keys of that section (e.g. the idle phase's heartbeat interval).
        self.config.write_text(yaml.safe_dump({
            "database": {"url": database_url, **(database or {})},
            "nats": {"url": nats_url, "subject_prefix": prefix, "request_timeout_ms": 5000},
            "coordinator": {"host": "127.0.0.1", "port": self.port, "missed_heartbeats": 20,
                            "lease_ttl_ms": LEASE_TTL_MS, "resume_grace_ms": LEASE_TTL_MS, **(coordinator or {})},
            "logging": {"format": "json", "level": "warning"},
            "state_dir": str(tmp / f"{name}-state"),
        }))
        self.popen: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> CoordinatorProc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
        env["PYTHONPATH"] = str(self.repo)
        with open(self.logfile, "ab") as out:
            self.started_at = time.perf_counter()
            self.popen = subprocess.Popen([sys.executable, "-m", "coordinator", "--config", str(self.config)],
                                          cwd=self.repo, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        return self

    def spy(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Profiling aid: with ``KVL_BENCH_PYSPY=<dir>``, py-spy samples the coordinator during a
        timed phase into ``<dir>/<name>-<phase>.txt`` (collapsed stacks); otherwise nothing."""
        prof = os.environ.get("KVL_BENCH_PYSPY")
        if not prof or self.popen is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def recording() -> Iterator[None]:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                    str(self.pid), "--rate", "250", "--format", "raw", "--nonblocking",
                                    "--output", str(Path(prof) / f"{self.name}-{phase}.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
            try:
                yield
            finally:
                spy.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spy.wait(20)
        return recording()

    async def wait_ready(self, timeout_s: float = 120, since: float | None = None) -> tuple[float, dict[str, Any]]:
        """Seconds from :meth:`start` (or from ``since``, a perf_counter time) to the first
        ``/readyz`` 200, and its body."""
        t, body = await self._poll_readyz(lambda status, body: status == 200, "ready", timeout_s)
        return t - (self.started_at if since is None else since), body

    async def wait_standby(self, position: int, timeout_s: float = 300) -> tuple[float, dict[str, Any]]:
        """Seconds from :meth:`start` until ``/readyz`` says standby (503) with the log followed
        up to ``position`` at least (the standby has loaded it and folds what the leader adds)."""
        def following(status: int, body: dict[str, Any]) -> bool:
            if status == 200:
                raise RuntimeError(f"coordinator {self.name} leads, but another one was expected to: {body}")
            return body.get("status") == "standby" and (body.get("position") or 0) >= position
        t, body = await self._poll_readyz(following, f"standby at position {position}", timeout_s)
        return t - self.started_at, body

    async def _poll_readyz(self, done: Callable[[int, dict[str, Any]], bool], what: str,
                           timeout_s: float) -> tuple[float, dict[str, Any]]:
        """Poll ``/readyz`` every 10 ms until ``done(status, body)``: (perf_counter then, body)."""
        import aiohttp
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while time.monotonic() < deadline:
                assert self.popen is not None
                if self.popen.poll() is not None:
                    raise RuntimeError(f"coordinator {self.name} exited ({self.popen.returncode}):\n{self.tail()}")
                try:
                    async with http.get(f"http://127.0.0.1:{self.port}/readyz") as r:
                        t = time.perf_counter()
                        body = await r.json(content_type=None)
                        if done(r.status, body):
                            return t, body
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass
                await asyncio.sleep(0.01)
        raise RuntimeError(f"coordinator {self.name} not {what} within {timeout_s} s:\n{self.tail()}")

    async def readyz(self) -> dict[str, Any]:
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(f"http://127.0.0.1:{self.port}/readyz") as r:
                return await r.json(content_type=None)

    async def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of each sample of Prometheus metric ``name``, from one scrape."""
        import aiohttp
        from prometheus_client.parser import text_string_to_metric_families
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(f"http://127.0.0.1:{self.port}/metrics") as r:
                text = await r.text()
        return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == name]

    def kill(self) -> float:
        """SIGKILL (no shutdown, no lock release: PostgreSQL ends its sessions); returns when (perf_counter)."""
        assert self.popen is not None
        t = time.perf_counter()
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        return t

    async def append_stats(self) -> tuple[float, float, float, float]:
        """Cumulative (transactions, events, seconds, transactions written by COPY) of the
        coordinator's group-commit appends."""
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(f"http://127.0.0.1:{self.port}/metrics") as r:
                text = await r.text()
        vals = {}
        for line in text.splitlines():
            for k in ("kvl_coordinator_append_batch_events_count", "kvl_coordinator_append_batch_events_sum",
                      "kvl_coordinator_append_latency_seconds_sum", 'kvl_coordinator_append_path_total{path="copy"}'):
                if line.startswith(k + " "):
                    vals[k] = float(line.split()[1])
        return (vals.get("kvl_coordinator_append_batch_events_count", 0.0),
                vals.get("kvl_coordinator_append_batch_events_sum", 0.0),
                vals.get("kvl_coordinator_append_latency_seconds_sum", 0.0),
                vals.get('kvl_coordinator_append_path_total{path="copy"}', 0.0))

    async def snapshots(self) -> float:
        """Snapshots the coordinator has saved since it started."""
        return sum(v for _, v in await self.samples("kvl_coordinator_snapshots_total"))

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def log_events(self, event: str) -> int:
        """How many times the coordinator logged ``event`` (e.g. ``leadership_lost``)."""
        text = self.logfile.read_text(errors="replace") if self.logfile.exists() else ""
        return sum(1 for line in text.splitlines() if f'"event": "{event}"' in line)

    def tail(self, n: int = 3000) -> str:
        return self.logfile.read_text(errors="replace")[-n:] if self.logfile.exists() else ""

    def stop(self) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


async def pg_facts(db_url: str) -> dict[str, Any]:
    import asyncpg
    conn = await asyncpg.connect(_plain(db_url))
    try:
        out = {"pg_version": (await conn.fetchval("SHOW server_version")).split()[0]}
        for k in ("fsync", "synchronous_commit"):
            out[f"pg_{k}"] = await conn.fetchval(f"SHOW {k}")
        return out
    finally:
        await conn.close()


# --- the echo responder (a separate process, like the coordinator) ----------------------------

async def echo_serve(nats_url: str, spec: str) -> None:
    """Reply to each ``subject=bytes`` of ``spec`` with that many bytes; print ``ready``; run until killed."""
    import nats
    nc = await nats.connect(nats_url)
    for item in spec.split(","):
        subject, _, size = item.partition("=")
        payload = b"x" * int(size)

        async def cb(msg: Any, payload: bytes = payload) -> None:
            await msg.respond(payload)
        await nc.subscribe(subject, cb=cb)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


class EchoProc:
    def __init__(self, nats_url: str, sizes: dict[str, int]) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        spec = ",".join(f"{s}={n}" for s, n in sizes.items())
        self.popen = subprocess.Popen([sys.executable, "-m", "bench.coordinator", "--echo-serve", spec,
                                       "--nats-url", nats_url], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      start_new_session=True)
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if line.strip() != b"ready":
            self.stop()
            raise RuntimeError("echo responder did not start")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()


# --- request driver ----------------------------------------------------------------------------

async def drive(nc: Any, subject: str, payloads: list[bytes], inflight: int, timeout_s: float = 30,
                recover: Callable[[bytes, float], Awaitable[bool]] | None = None
                ) -> tuple[float, list[float], list[bytes]]:
    """``inflight`` concurrent request loops over ``payloads``: (wall seconds, latencies, replies).

    ``recover(reply, sent_at)``: True if the request is to be sent again (the worker was
    suspended by a coordinator takeover and has resumed); its latency then includes the resume."""
    n = len(payloads)
    lat = [0.0] * n
    replies: list[bytes] = [b""] * n
    it = iter(range(n))
    perf = time.perf_counter

    async def loop() -> None:
        for i in it:
            t0 = perf()
            r = await nc.request(subject, payloads[i], timeout=timeout_s)
            while recover is not None and await recover(r.data, t0):
                r = await nc.request(subject, payloads[i], timeout=timeout_s)
            lat[i] = perf() - t0
            replies[i] = r.data

    t0 = perf()
    await asyncio.gather(*(loop() for _ in range(inflight)))
    return perf() - t0, lat, replies


def append_delta(a: tuple[float, ...], b: tuple[float, ...], prefix: str,
                 wall_s: float | None = None) -> dict[str, float]:
    """Group-commit appends between two :meth:`CoordinatorProc.append_stats` readings
    (``<prefix>_append_copy_txs``: how many were written by COPY); with ``wall_s``, also
    ``<prefix>_append_busy_share``: the part of that wall time an append was in flight (one at a
    time), near 1 when the appends, not the coordinator's CPU, set the rate."""
    txs = max(b[0] - a[0], 1e-9)
    out = {f"{prefix}_append_txs": round(b[0] - a[0]), f"{prefix}_append_events_per_tx": round((b[1] - a[1]) / txs, 1),
           f"{prefix}_append_ms_mean": round(1000 * (b[2] - a[2]) / txs, 2),
           f"{prefix}_append_copy_txs": round(b[3] - a[3])}
    if wall_s:
        out[f"{prefix}_append_busy_share"] = round((b[2] - a[2]) / wall_s, 3)
    return out


def cpu_seconds(coordinator_pid: int | None) -> dict[str, dict[int, float]]:
    """CPU seconds so far, per process, of those an ingest or lease run keeps busy: the
    coordinator, every ``postgres`` and ``nats-server`` process on the machine, and this process."""
    return stack_cpu({"coordinator": coordinator_pid or -1})


def cpu_delta(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]], n: int,
              prefix: str) -> dict[str, float]:
    """CPU microseconds per operation, by role, between two :func:`cpu_seconds` readings."""
    return {f"{prefix}_cpu_us_per_op_{role}": round(1e6 * s / n, 1) for role, s in cpu_spent(a, b).items()}


def rate_summary(n: int, wall: float, lat: list[float]) -> dict[str, float]:
    return {"per_s": n / wall, "p50_ms": 1000 * pct(lat, 0.50), "p99_ms": 1000 * pct(lat, 0.99),
            "mean_ms": 1000 * statistics.fmean(lat)}
