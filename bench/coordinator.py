"""Coordinator benchmark: durable ingest, lease acquire, idle liveness, replay, restart and
standby takeover — each against a baseline measured in the same run on the same machine.

The coordinator runs as its own process (``python -m coordinator``, as in production) on a
fresh database and a unique subject prefix; this process plays the worker over NATS. The
bench worker keeps its epoch across a coordinator takeover the way a real one does: told
SUSPENDED, it resumes with the digests of the replicas it committed (never re-registers).

* **ingest** — a synthetic worker holds write leases on N blocks, then publishes N commit
  transitions (ALLOCATED → READY) to JetStream (``publish_async``, ``Nats-Msg-Id`` =
  source id, as a worker's outbox would, but pipelined). Timed from the first publish to
  the commit watermark that covers the last seq: decode, judge, apply, group-commit
  append to PostgreSQL, ack. Baseline: ``COPY`` (asyncpg ``copy_records_to_table``) of N
  rows with the very payloads the coordinator stores into a scratch table ``LIKE events
  INCLUDING ALL`` (same columns, constraints and indexes), measured before and after the
  ingest (the baseline is their mean).
* **backlog** — the same on a backlog: the coordinator is stopped, N more commit transitions
  are published (as workers keep doing while no coordinator runs), and it is started again:
  from its ``/readyz`` 200 until the watermark covers the last (``ingest_backlog_*``). The
  coordinator's own drain rate, without the publisher competing for the machine's cores.
* **full pool** — the core alone, in this process: the decision cost of a 16-block write grant
  on a worker whose pool (100k slots; quick 10k) is full of READY replicas, so that every
  written block evicts one (``grant_full_pool_us``). Baseline: scanning the pool for the same
  victims (``grant_full_pool_scan_us``), what the core did before its LRU index. Then the
  decision of that worker's resume holding the whole pool (``resume_full_pool_ms``,
  ``resume_full_pool_us_per_replica``; no baseline: what every worker costs after a takeover).
* **leases** — ``--inflight`` (64) concurrent LeaseAcquire requests, total N, each for a
  16-block prompt whose first 12 blocks are cached (READY: pinned for reading) and whose
  last 4 are not (write grants), ``reuse=True``; then every lease is released the same way
  (its 4 unfilled writes abort). Throughput and per-request latency p50/p99. Baseline: a
  trivial nats-py responder process replying with a byte string of the real reply's size,
  driven with the same request bytes, concurrency and N, before and after the lease run.
  Also a few hundred requests one at a time (latency without queueing), both ways.
* **idle** — ``--idle-workers`` (8; quick 4) registered workers holding nothing heartbeat
  every ``--idle-heartbeat-ms`` (100: time compressed 10×) to a coordinator configured with
  that interval; the events appended to the log during ``--idle-seconds`` (30; quick 10) and
  the heartbeats it answered (its ``kvl_coordinator_requests_total{op="heartbeat"}``), per
  worker per hour *at the default 1 s interval* (:func:`idle_rates`). No baseline: before
  heartbeats became soft state every heartbeat was an event (3600 per worker per hour).
* **replay** — a log of ``--replay-events`` (1M) events built by the real core commands
  (register, acquire with reuse and LRU eviction, commit transitions, release)
  and bulk-loaded with COPY into a fresh database; then ``coordinator.replay.load_state``
  (the code a restart runs) from empty. Baseline: reading the same rows (same columns,
  same pages) with raw asyncpg, no decode or fold. Also the pure fold rate (decode + apply
  of the in-memory payloads, no I/O).
* **restart** — a coordinator process started on that log with a snapshot taken 2% before
  its end: process start → ``/readyz`` 200 (``restart_history_events`` says how long the log
  was; ``snapshot_bytes``, ``snapshot_replicas`` what the snapshot held). Baseline: the same on
  an empty log (the first coordinator's start, which also creates the schema).
* **takeover** — that coordinator leads; a worker commits 256 blocks, a second coordinator
  process on the same database and prefix waits as a hot standby (``/readyz`` 503
  ``standby``, the log followed up to the leader's position), the worker churns leases one at
  a time for 2 s, then the leader is killed (SIGKILL): kill → the standby's ``/readyz`` 200.
  ``--takeover-rounds`` (3; quick 1) times, each standby the next round's leader; the
  figure is the slowest round. Baseline: ``restart_to_ready_s`` (a cold start that loads the
  snapshot and replays the tail). Also how many events the standby still had to fold, when
  the worker had resumed (keeping all 256) and when the new leader granted its first lease.

    python -m bench.coordinator            # 100k ingest, 20k leases, 8 idle workers 30 s, 1M-event replay
    python -m bench.coordinator --quick    # 10k ingest, 2k leases, 4 idle workers 10 s, 50k-event replay

Services: ``--database-url``/``--nats-url`` (default ``$KVL_DATABASE_URL``/``$KVL_NATS_URL``),
else embedded PostgreSQL and NATS are started. Progress goes to stderr; the last line
printed to stdout is one JSON object: every figure with its baseline and ratio, N per
phase, CPU microseconds per operation by process (``*_cpu_us_per_op_*``: coordinator, all
postgres and nats-server processes on the machine, this process), the group-commit
batches, how often the coordinator lost leadership, which goals were met, the load average.
``--only ingest,leases,idle,replay`` runs a subset (replay includes restart and takeover).
``KVL_BENCH_PYSPY=<dir>`` (py-spy installed) samples the coordinator during the timed ingest
and lease phases into ``<dir>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from bench.proc_cpu import cpu_spent, process_cpu, stack_cpu
from coordinator.log.chain import GENESIS, link

REPO = Path(__file__).resolve().parents[1]
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


def _log(msg: str) -> None:
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


# --- the synthetic worker ---------------------------------------------------------------------

class BenchWorker:
    """A synthetic worker: registers, heartbeats, and keeps its epoch across a coordinator takeover.

    A takeover (a restart, a standby taking over, or the leader stepping down and back up)
    suspends every live epoch: heartbeats, acquires and renewals then get
    ``ErrorReply(code=suspended)``. The bench worker then resumes (``WorkerResume``, in ordered
    parts when the inventory exceeds one NATS message) with the digests of the replicas it
    committed (:meth:`note_committed`); it never re-registers, since
    a new epoch would lose what the timed phases set up. It does not track evictions (the
    bench's pools never fill), so every committed replica is still held.
    """

    def __init__(self, nc: Any, subjects: Any, slots: int, worker_id: str = WORKER) -> None:
        self.nc = nc
        self.subjects = subjects
        self.worker_id = worker_id
        self.slots = slots
        self.epoch = 0
        self.watermark = 0
        self._wm_target = 0
        self._wm_event = asyncio.Event()
        self._hb: asyncio.Task[None] | None = None
        self._wm_sub: Any = None
        #: (block hash, seq) of every commit (ALLOCATED → READY) this worker emitted.
        self.committed: list[tuple[str, int]] = []
        self.emitted_seq = 0
        self.heartbeats_ok = 0
        self.heartbeats_refused = 0
        #: ``(perf_counter, ResumeReply)`` of every resume.
        self.resumes: list[tuple[float, Any]] = []
        self._resume_lock = asyncio.Lock()
        self._resumed = asyncio.Event()

    async def request(self, subject: str, msg: Any, timeout: float = 30) -> Any:
        """One request; a SUSPENDED answer is followed by a resume and the request once more."""
        from shared.messages import ErrorCode, ErrorReply, decode, encode
        data = encode(msg)
        seen = len(self.resumes)
        reply = decode((await self.nc.request(subject, data, timeout=timeout)).data)
        if isinstance(reply, ErrorReply) and reply.code == ErrorCode.SUSPENDED:
            await self.resume(seen)
            reply = decode((await self.nc.request(subject, data, timeout=timeout)).data)
        return reply

    async def register(self) -> None:
        from shared.messages import ErrorReply, WorkerRegister
        r = await self.request(self.subjects.request("register", self.worker_id), WorkerRegister(
            worker_id=self.worker_id, namespace=NS, catalogue=catalogue(), pool_slots={"compressed": self.slots}))
        if isinstance(r, ErrorReply):
            raise RuntimeError(f"register refused: {r.code}: {r.message}")
        self.epoch = r.epoch
        self._hb = asyncio.create_task(self._heartbeats(r.heartbeat_interval_ms / 1000))

        from shared.messages import CommitWatermark, decode

        async def on_wm(msg: Any) -> None:
            wm = decode(msg.data, expect=CommitWatermark)
            if wm.epoch == self.epoch and wm.seq > self.watermark:
                self.watermark = wm.seq
                if self.watermark >= self._wm_target:
                    self._wm_event.set()
        self._wm_sub = await self.nc.subscribe(self.subjects.watermark(self.worker_id), cb=on_wm)

    async def _heartbeats(self, interval: float) -> None:
        from shared.messages import ErrorCode, ErrorReply, Heartbeat, HeartbeatReply, decode, encode
        data = encode(Heartbeat(worker_id=self.worker_id, epoch=self.epoch))
        while True:
            await asyncio.sleep(interval)
            seen = len(self.resumes)
            try:
                r = decode((await self.nc.request(self.subjects.request("heartbeat", self.worker_id), data, timeout=10)).data)
            except Exception:  # noqa: BLE001 - no coordinator answering (a takeover under way): next beat
                self.heartbeats_refused += 1
                continue
            if isinstance(r, HeartbeatReply):
                self.heartbeats_ok += 1
                continue
            self.heartbeats_refused += 1
            if isinstance(r, ErrorReply) and r.code == ErrorCode.SUSPENDED:
                with contextlib.suppress(Exception):
                    await self.resume(seen)

    def note_committed(self, pairs: list[tuple[str, int]]) -> None:
        """Commits (block hash, seq) now in the log: replicas this worker holds READY."""
        self.committed.extend(pairs)

    def held(self) -> bytes:
        """The resume inventory: the :func:`shared.hashing.replica_digest` of each committed replica
        (generation 1, checksum = the commit's seq, as :func:`commit_transition` writes them)."""
        from shared.hashing import replica_digest
        gpu = f"gpu:{self.worker_id}"
        return b"".join(replica_digest(bh, "compressed", gpu, 1, f"{seq:016x}") for bh, seq in self.committed)

    async def resume(self, seen: int) -> Any:
        """Resume the (suspended) epoch once: ``seen`` is how many resumes the caller knew of
        when it was told SUSPENDED, so concurrent callers trigger one resume, not one each."""
        from shared.messages import ErrorCode, ErrorReply, ResumeReply, WorkerResume, decode, encode
        async with self._resume_lock:
            if len(self.resumes) > seen:
                return self.resumes[-1][1]
            import nats.errors

            from shared.hashing import REPLICA_DIGEST_BYTES
            held = self.held()
            # NOTE: one 8-byte digest per replica, base64 in JSON: past ~98k replicas an inventory
            # exceeds NATS's default 1 MiB max_payload, so it goes in ordered parts, each well
            # within it (as the worker's client sends them); the last part's answer decides.
            limit = (getattr(self.nc, "max_payload", 0) or 1 << 20) - 16 * 1024
            per_part = max(1, limit * 3 // 4 // REPLICA_DIGEST_BYTES) * REPLICA_DIGEST_BYTES
            n = max(1, -(-len(held) // per_part))
            parts = [encode(WorkerResume(worker_id=self.worker_id, epoch=self.epoch, namespace=NS,
                                         catalogue=catalogue(), pool_slots={"compressed": self.slots},
                                         emitted_seq=self.emitted_seq, part=i, parts=n,
                                         held=held[i * per_part:(i + 1) * per_part])) for i in range(n)]
            deadline = time.monotonic() + 60
            i = 0
            while True:
                try:
                    r = decode((await self.nc.request(self.subjects.request("resume", self.worker_id), parts[i], timeout=10)).data)
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError) as e:
                    # no coordinator answering yet (between the old leader and the new one): retry
                    r = ErrorReply(code=ErrorCode.UNAVAILABLE, message=f"{type(e).__name__}: {e}",
                                   retry_after_ms=100)
                if isinstance(r, ResumeReply) and r.complete == (i == n - 1):
                    if not r.complete:
                        i += 1
                        continue
                    self.resumes.append((time.perf_counter(), r))
                    self._resumed.set()
                    return r
                if not isinstance(r, ErrorReply):
                    raise RuntimeError(f"worker {self.worker_id}: unexpected answer to resume part {i} of {n}: {r}")
                if r.code in (ErrorCode.FENCED, ErrorCode.NOT_FOUND, ErrorCode.INVALID):
                    # NOTE: a bench worker never re-registers: a new epoch would lose what the
                    # timed phases set up, and the figures would silently measure something else.
                    raise RuntimeError(f"worker {self.worker_id} epoch {self.epoch} cannot resume: "
                                       f"{r.code}: {r.message}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.worker_id} could not resume within 60 s: {r.code}: {r.message}")
                i = 0  # a multi-part resume starts again from its first part
                await asyncio.sleep(max(r.retry_after_ms, 20) / 1000)

    async def recover(self, data: bytes, sent_at: float) -> bool:
        """For :func:`drive`: True (after resuming, unless a resume completed since ``sent_at``,
        a perf_counter time) if ``data`` is a SUSPENDED answer: the request is to be sent again."""
        from shared.messages import ErrorCode, ErrorReply, decode
        if b'"suspended"' not in data:
            return False
        r = decode(data)
        if not (isinstance(r, ErrorReply) and r.code == ErrorCode.SUSPENDED):
            return False
        await self.resume(sum(1 for t, _ in self.resumes if t < sent_at))
        return True

    async def wait_watermark(self, seq: int, timeout_s: float) -> None:
        self._wm_target = seq
        self._wm_event.clear()
        if self.watermark >= seq:
            return
        await asyncio.wait_for(self._wm_event.wait(), timeout_s)

    async def wait_resumed(self, after: float, timeout_s: float) -> tuple[float, Any]:
        """The first resume at or after ``after`` (a perf_counter time): (its time, its ResumeReply)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for t, r in self.resumes:
                if t >= after:
                    return t, r
            self._resumed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"worker {self.worker_id} did not resume within {timeout_s} s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._resumed.wait(), left)

    def stop(self) -> None:
        if self._hb is not None:
            self._hb.cancel()

    def acquire(self, hashes: list[str], *, write: bool, reuse: bool, request_id: str = "r") -> Any:
        from shared.messages import LeaseAcquire
        return LeaseAcquire(worker_id=self.worker_id, epoch=self.epoch, request_id=request_id, namespace=NS,
                            block_hashes=hashes, write_forms=["compressed"] if write else [], reuse=reuse,
                            ttl_ms=LEASE_TTL_MS)

    def release(self, lease_id: str) -> Any:
        from shared.messages import LeaseRelease
        return LeaseRelease(worker_id=self.worker_id, epoch=self.epoch, lease_id=lease_id)


def commit_transition(epoch: int, seq: int, hashes: list[str], i: int, lease_id: str, ts: int,
                      worker: str = WORKER) -> Any:
    """The commit (ALLOCATED → READY) of block ``i`` of a lease's ``hashes``."""
    from shared.ids import ROOT_HASH
    from shared.messages import ReplicaState, TransitionEvent
    return TransitionEvent(
        worker_id=worker, epoch=epoch, seq=seq, namespace=NS, block_hash=hashes[i],
        parent_hash=hashes[i - 1] if i else ROOT_HASH, token_start=BLOCK * i, token_end=BLOCK * (i + 1),
        form="compressed", location=f"gpu:{worker}", from_state=ReplicaState.ALLOCATED,
        to_state=ReplicaState.READY, generation=1, checksum=f"{seq:016x}", lease_id=lease_id,
        block_size=BLOCK, model_name="bench", ts_ms=ts)


# --- phase (a): durable ingest ---------------------------------------------------------------

async def copy_baseline(db_url: str, rows: list[tuple[Any, ...]], tag: str) -> float:
    """Seconds to COPY ``rows`` into a fresh ``LIKE events INCLUDING ALL`` table (then dropped)."""
    import asyncpg
    conn = await asyncpg.connect(db_url)
    table = f"bench_copy_{tag}"
    try:
        await conn.execute(f"CREATE TABLE {table} (LIKE events INCLUDING ALL)")
        t0 = time.perf_counter()
        await conn.copy_records_to_table(table, records=rows, columns=COLUMNS)
        dt = time.perf_counter() - t0
        await conn.execute(f"DROP TABLE {table}")
        return dt
    finally:
        await conn.close()


async def grant_writes(w: BenchWorker, hashes: list[str], what: str) -> tuple[list[tuple[str, list[str]]], float]:
    """Write leases on ``hashes`` (``SETUP_LEASE_BLOCKS`` per lease): ``[(lease id, its blocks)]``
    and the seconds it took."""
    from shared.messages import ErrorReply, LeaseGrant

    n = len(hashes)
    _log(f"{what}: granting write leases on {n} blocks ({SETUP_LEASE_BLOCKS} per lease) ...")
    t0 = time.perf_counter()
    leases: list[tuple[str, list[str]]] = []
    for k in range(0, n, SETUP_LEASE_BLOCKS):
        chunk = hashes[k:k + SETUP_LEASE_BLOCKS]
        g = await w.request(w.subjects.request("acquire", w.worker_id), w.acquire(chunk, write=True, reuse=False))
        if isinstance(g, ErrorReply) or not isinstance(g, LeaseGrant):
            raise RuntimeError(f"setup lease refused: {g}")
        if g.write.get("compressed") != list(range(len(chunk))):
            raise RuntimeError(f"setup lease granted {len(g.write.get('compressed', []))} of {len(chunk)} writes")
        leases.append((g.lease_id, chunk))
    setup_s = time.perf_counter() - t0
    _log(f"{what}: {n} ALLOCATED replicas in {setup_s:.1f} s ({n / setup_s:,.0f} grants/s, setup only)")
    return leases, setup_s


def commits(w: BenchWorker, leases: list[tuple[str, list[str]]], seq0: int
            ) -> tuple[list[tuple[bytes, str]], list[tuple[Any, ...]]]:
    """The commit transition of every block of ``leases`` (seqs from ``seq0 + 1``), encoded with its
    source id, and the row the coordinator will store for each (for the COPY baseline)."""
    from coordinator.core.events import TransitionApplied
    from coordinator.ledger import to_new_event
    from shared.messages import encode, now_ms

    ts = now_ms()
    msgs: list[tuple[bytes, str]] = []
    rows: list[tuple[Any, ...]] = []
    chained = GENESIS   # the baseline stores the chain hash too (the coordinator's rows carry one)
    seq = seq0
    for lease_id, chunk in leases:
        for i in range(len(chunk)):
            seq += 1
            t = commit_transition(w.epoch, seq, chunk, i, lease_id, ts, w.worker_id)
            msgs.append((encode(t), t.source_id))
            # exactly what the coordinator will store for it
            ne = to_new_event(TransitionApplied(transition=t, kind="commit", at_ms=ts))
            chained = link(chained, seq, 1, ne.stream_id, ne.type, ne.source_id, ne.payload)
            rows.append((seq, ne.stream_id, 2, ne.source_id, ne.type, ne.payload.decode(), 1, chained))
    return msgs, rows


async def publish_all(nc: Any, subject: str, msgs: list[tuple[bytes, str]]) -> float:
    """Publish ``msgs`` to JetStream, pipelined, each with its source id as ``Nats-Msg-Id``; seconds
    until JetStream has stored them all."""
    js = nc.jetstream(timeout=30, publish_async_max_pending=4000)
    futs = []
    t0 = time.perf_counter()
    for data, sid in msgs:
        futs.append(await js.publish_async(subject, data, headers={"Nats-Msg-Id": sid}))
    await js.publish_async_completed()
    bad = [f for f in futs if f.exception() is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} publishes failed: {bad[0].exception()}")
    return time.perf_counter() - t0


async def worker_publish(nats_url: str, w: BenchWorker, events: list[Any], batch: int) -> tuple[float, int]:
    """``events`` (the worker's next seqs) through the worker's own path: its outbox and
    :class:`worker.publisher.TransitionPublisher` (``batch`` transitions per JetStream message,
    each message's broker ack awaited before the next) over its NATS client. Seconds from the
    first emit until the commit watermark covers the last, and the messages sent."""
    from worker.client.nats_adapter import NatsCoordinatorClient
    from worker.metrics import WorkerMetrics
    from worker.publisher import TransitionPublisher

    client = NatsCoordinatorClient(nats_url, w.subjects, timeout_s=30, name="bench.coordinator worker path")
    await client.connect()
    metrics = WorkerMetrics()
    pub = TransitionPublisher(client, capacity=len(events) + 1, resend_ms=600_000, metrics=metrics, batch=batch)
    pub.new_epoch(w.worker_id, w.epoch)
    seq0 = events[0].seq - 1
    assert pub.outbox is not None
    pub.outbox.next_seq, pub.outbox.watermark = seq0 + 1, seq0
    try:
        t0 = time.perf_counter()
        for ev in events:
            pub.emit(lambda seq, ev=ev: ev)
        while await pub.publish_due():
            pass
        await w.wait_watermark(events[-1].seq, timeout_s=max(120, len(events) / 500))
        t = time.perf_counter() - t0
    finally:
        await client.close()
    w.emitted_seq = max(w.emitted_seq, events[-1].seq)
    return t, int(metrics.published_messages._value.get())


async def ingest_phase(nc: Any, nats_url: str, coord: CoordinatorProc, w: BenchWorker, db_url: str,
                       n: int) -> dict[str, Any]:
    """Durable ingest of ``n`` commit transitions through the worker's own path with its default
    batching (:func:`worker_publish`); baseline COPY of the rows the coordinator stores."""
    from shared.config import WorkerConfig
    from shared.messages import decode

    batch = WorkerConfig().publish_batch
    hashes = [h(i + 1) for i in range(n)]
    leases, setup_s = await grant_writes(w, hashes, "ingest")
    msgs, rows = commits(w, leases, w.emitted_seq)
    msg_bytes = statistics.fmean(len(m) for m, _ in msgs)
    row_bytes = statistics.fmean(len(r[5]) for r in rows)

    _log(f"ingest: baseline COPY of {n} rows ({row_bytes:.0f}-byte payloads) ...")
    copy1 = await copy_baseline(db_url, rows, "before")
    _log(f"ingest: COPY {n / copy1:,.0f} rows/s")

    _log(f"ingest: {n} commit transitions ({msg_bytes:.0f} bytes each) through the worker's publisher, "
         f"{batch} per message ...")
    seq0 = w.emitted_seq
    st0 = await coord.append_stats()
    with coord.spy("ingest"):
        cpu0 = cpu_seconds(coord.pid)
        t_ingest, sent = await worker_publish(nats_url, w, [decode(m) for m, _ in msgs], batch)
    cpu = cpu_delta(cpu0, cpu_seconds(coord.pid), n, "ingest")
    _log(f"ingest: watermark {w.emitted_seq} after {t_ingest:.2f} s ({sent} messages): {n / t_ingest:,.0f} "
         "events/s durable")
    w.note_committed([(bh, seq0 + k + 1) for k, bh in enumerate(bh for _, chunk in leases for bh in chunk)])
    appends = append_delta(st0, await coord.append_stats(), "ingest", t_ingest)
    _log(f"ingest: {appends}; {cpu}")

    copy2 = await copy_baseline(db_url, rows, "after")
    _log(f"ingest: COPY (again) {n / copy2:,.0f} rows/s")

    # Put the log back as a worker would leave it: every lease released (nothing to abort).
    for lease_id, _ in leases:
        await w.request(w.subjects.request("release", w.worker_id), w.release(lease_id))

    copy_rate = statistics.fmean([n / copy1, n / copy2])
    rate = n / t_ingest
    return {
        "ingest_events": n, "ingest_events_per_s": round(rate), "ingest_seconds": round(t_ingest, 3),
        "ingest_publish_batch": batch, "ingest_messages": sent, "ingest_message_bytes": round(msg_bytes),
        "ingest_payload_bytes": round(row_bytes),
        "copy_rows_per_s": round(copy_rate), "copy_rows_per_s_before": round(n / copy1),
        "copy_rows_per_s_after": round(n / copy2),
        "ingest_ratio_vs_copy": round(rate / copy_rate, 3),
        "ingest_setup_grants_per_s": round(n / setup_s), **appends, **cpu,
        "_hashes": hashes,
    }


#: Block numbers of the ingest comparison's blocks (apart from the others').
INGEST_CMP_BLOCK0 = 1 << 37


async def ingest_compare_phase(nc: Any, nats_url: str, coord: CoordinatorProc, w: BenchWorker, n_single: int,
                               n_old: int, batched_rate: float, copy_rate: float) -> dict[str, Any]:
    """The same ingest without the worker's batching, on fresh blocks, after the lease phase (so
    that phase's state is what it was before the comparison existed): ``n_single`` transitions
    one message each, pipelined (``publish_async``: the coordinator's per-message cost), then
    ``n_old`` through the worker's publisher one message each (the worker's path before batching:
    one broker round trip per transition)."""
    from shared.messages import decode

    hashes = [h(INGEST_CMP_BLOCK0 + i) for i in range(n_single + n_old)]
    leases, _ = await grant_writes(w, hashes, "ingest (unbatched)")
    seq0 = w.emitted_seq
    msgs, _ = commits(w, leases, seq0)
    _log(f"ingest (unbatched): {n_single} transitions, one message each, pipelined (publish_async) ...")
    cpu0 = cpu_seconds(coord.pid)
    t0 = time.perf_counter()
    t_pub = await publish_all(nc, w.subjects.events(w.worker_id), msgs[:n_single])
    w.emitted_seq = seq0 + n_single
    await w.wait_watermark(w.emitted_seq, timeout_s=max(120, n_single / 500))
    t_single = time.perf_counter() - t0
    cpu = cpu_delta(cpu0, cpu_seconds(coord.pid), n_single, "ingest_single")
    _log(f"ingest (unbatched): one per message: {n_single / t_single:,.0f} events/s durable; {cpu}")
    _log(f"ingest (unbatched): {n_old} through the worker's publisher one message each (as before batching) ...")
    t_old, _ = await worker_publish(nats_url, w, [decode(m) for m, _ in msgs[n_single:]], 1)
    _log(f"ingest (unbatched): worker path one message each: {n_old / t_old:,.0f} events/s durable")
    w.note_committed([(bh, seq0 + k + 1) for k, bh in enumerate(bh for _, chunk in leases for bh in chunk)])
    for lease_id, _ in leases:
        await w.request(w.subjects.request("release", w.worker_id), w.release(lease_id))
    return {
        "ingest_single_events": n_single, "ingest_single_events_per_s": round(n_single / t_single),
        "ingest_single_publish_per_s": round(n_single / t_pub),
        "ingest_single_ratio_vs_copy": round(n_single / t_single / copy_rate, 3),
        "ingest_worker_unbatched_events": n_old, "ingest_worker_unbatched_events_per_s": round(n_old / t_old),
        "ingest_batch_speedup_vs_unbatched_worker": round(batched_rate / (n_old / t_old), 2), **cpu,
    }


#: Block numbers of the backlog phase's blocks (apart from the others').
BACKLOG_BLOCK0 = 1 << 36


async def backlog_phase(nc: Any, coord: CoordinatorProc, w: BenchWorker, n: int, copy_rate: float) -> dict[str, Any]:
    """Durable ingest of a backlog: the coordinator is stopped, ``n`` commit transitions are
    published in batches (as workers keep doing while no coordinator runs), it is started again: from its
    ``/readyz`` 200 until the watermark covers the last one. What a coordinator's own pipeline
    (JetStream delivery, decode, judge, apply, append, ack) drains per second, without the
    publisher competing for this machine's two cores as it does in :func:`ingest_phase`."""
    from shared.config import WorkerConfig
    from shared.messages import TransitionBatch, decode, encode

    hashes = [h(BACKLOG_BLOCK0 + i) for i in range(n)]
    leases, _ = await grant_writes(w, hashes, "backlog")
    seq0 = w.emitted_seq
    msgs, _ = commits(w, leases, seq0)
    # as workers leave them: batches of worker.publish_batch transitions
    size = WorkerConfig().publish_batch
    batches = [TransitionBatch(worker_id=w.worker_id, epoch=w.epoch, events=[decode(m) for m, _ in msgs[k:k + size]])
               for k in range(0, n, size)]
    _log("backlog: stopping the coordinator ...")
    coord.stop()
    t_pub = await publish_all(nc, w.subjects.events(w.worker_id), [(encode(b), b.source_id) for b in batches])
    w.emitted_seq = seq0 + n
    _log(f"backlog: {n} commit transitions in {len(batches)} messages stored by JetStream in {t_pub:.2f} s; "
         "starting the coordinator ...")
    coord.start()
    ready_s, _ = await coord.wait_ready()
    t0 = time.perf_counter()
    st0 = await coord.append_stats()
    cpu0 = cpu_seconds(coord.pid)
    await w.wait_watermark(seq0 + n, timeout_s=max(120, n / 500))
    t = time.perf_counter() - t0
    cpu = cpu_delta(cpu0, cpu_seconds(coord.pid), n, "ingest_backlog")
    appends = append_delta(st0, await coord.append_stats(), "ingest_backlog", t)
    rate = n / t
    _log(f"backlog: ready {ready_s:.2f} s after its start; watermark {seq0 + n} {t:.2f} s later: {rate:,.0f} "
         f"events/s durable; {appends}; {cpu}")
    w.note_committed([(bh, seq0 + k + 1) for k, bh in enumerate(bh for _, chunk in leases for bh in chunk)])
    for lease_id, _ in leases:
        await w.request(w.subjects.request("release", w.worker_id), w.release(lease_id))
    return {"ingest_backlog_events": n, "ingest_backlog_events_per_s": round(rate),
            "ingest_backlog_seconds": round(t, 3), "ingest_backlog_ratio_vs_copy": round(rate / copy_rate, 3),
            "ingest_backlog_restart_to_ready_s": round(ready_s, 3), **appends, **cpu}


# --- phase (b'): a write grant on a full pool (the core alone) ---------------------------------

#: Slots of the full pool and write grants timed on it (the scan baseline costs O(slots) each):
#: full run, quick run.
FULL_POOL = {False: (100_000, 300), True: (10_000, 500)}


def full_pool_phase(slots: int, grants: int) -> dict[str, Any]:
    """The decision cost of a 16-block write grant on a worker whose pool is full of READY
    replicas (every written block evicts one, least recently used first), in this process:
    ``coordinator.core.acquire_lease`` + apply, with the pool's LRU index. Baseline: the same
    victims found by scanning the pool (what the core did before the index: every READY
    unpinned replica, then the k least recently used), timed on the same state."""
    import heapq

    from coordinator import core
    from coordinator.core.lifecycle import READY
    from shared import messages as m

    s = core.LedgerState.empty(core.CoreParams(lease_ttl_ms=LEASE_TTL_MS))
    now = m.now_ms()
    reply, evs = core.register_worker(s, m.WorkerRegister(worker_id="w", namespace=NS, catalogue=catalogue(),
                                                          pool_slots={"compressed": slots}), now)
    for e in evs:
        core.apply(s, e)
    hashes = [h(i + 1) for i in range(slots)]
    _, evs = core.acquire_lease(s, m.LeaseAcquire(worker_id="w", epoch=reply.epoch, request_id="fill", namespace=NS,
                                                  block_hashes=hashes, write_forms=["compressed"], reuse=False,
                                                  ttl_ms=LEASE_TTL_MS), now, "fill")
    for e in evs:
        core.apply(s, e)
    for i in range(slots):
        for e in core.ingest_transition(s, commit_transition(reply.epoch, i + 1, hashes, i, "fill", now, "w"), now + i):
            core.apply(s, e)
    for e in core.release_lease(s, m.LeaseRelease(worker_id="w", epoch=reply.epoch, lease_id="fill"), now)[1]:
        core.apply(s, e)
    pool = s.pools[("w", "compressed")]
    t_index = t_scan = 0.0
    with core.state.no_gc():
        for k in range(grants):
            hs = [h(slots + 10 + PROMPT_BLOCKS * k + j) for j in range(PROMPT_BLOCKS)]
            msg = m.LeaseAcquire(worker_id="w", epoch=reply.epoch, request_id=f"g{k}", namespace=NS, block_hashes=hs,
                                 write_forms=["compressed"], ttl_ms=LEASE_TTL_MS)
            t0 = time.perf_counter()
            mine = set(hs)
            scan = heapq.nsmallest(PROMPT_BLOCKS, [r for key in pool if (r := s.replicas[key]).state is READY
                                                   and not r.pins and key[0] not in mine],
                                   key=lambda r: (r.last_used_ms, r.block_hash))
            t1 = time.perf_counter()
            grant, evs = core.acquire_lease(s, msg, now + slots + k, f"l{k}")
            for e in evs:
                core.apply(s, e)
            t2 = time.perf_counter()
            if [v.block_hash for v in grant.evict] != [r.block_hash for r in scan]:
                raise RuntimeError("the LRU index chose other victims than a scan of the pool")
            t_scan += t1 - t0
            t_index += t2 - t1
    if core.check_invariants(s):
        raise RuntimeError(f"full-pool phase: invariants broken: {core.check_invariants(s)[:3]}")
    # A resume of that worker, holding all of it (what every worker sends after a takeover): the
    # decision alone, on the coordinator's thread, with the inventory the worker would send.
    from shared.hashing import replica_digests
    held = [(key, r) for key in pool if (r := s.replicas[key]).state is READY]
    inventory = b"".join(replica_digests((k[0], k[1], k[2], r.generation, r.checksum) for k, r in held))
    resume = m.WorkerResume(worker_id="w", epoch=reply.epoch, namespace=NS, catalogue=catalogue(),
                            pool_slots={"compressed": slots}, held=inventory)
    t_resume = []
    with core.state.no_gc():
        for _ in range(3):
            t0 = time.perf_counter()
            answer, _ = core.resume_worker(s, resume, now + slots + grants)
            t_resume.append(time.perf_counter() - t0)
    if not isinstance(answer, m.ResumeReply) or answer.kept != len(held):
        raise RuntimeError(f"full-pool phase: the resume kept {getattr(answer, 'kept', answer)} of {len(held)}")
    resume_s = statistics.median(t_resume)
    return {"full_pool_slots": slots, "full_pool_grants": grants,
            "grant_full_pool_us": round(1e6 * t_index / grants, 1),
            "grant_full_pool_scan_us": round(1e6 * t_scan / grants, 1),
            "grant_full_pool_speedup_vs_scan": round(t_scan / t_index, 1),
            "resume_full_pool_replicas": len(held), "resume_full_pool_ms": round(1e3 * resume_s, 1),
            "resume_full_pool_us_per_replica": round(1e6 * resume_s / len(held), 2)}


# --- phase (b): leases ------------------------------------------------------------------------

async def lease_phase(nc: Any, nats_url: str, coord: CoordinatorProc, w: BenchWorker, cached: list[str], n: int,
                      inflight: int, first_new: int) -> dict[str, Any]:
    from shared.messages import LeaseGrant, LeaseReleased, decode, encode

    rng = random.Random(7)
    fresh = iter(range(first_new, first_new + 10 * n * PROMPT_BLOCKS))

    def prompt(k: int) -> bytes:
        s = rng.randrange(0, len(cached) - CACHED_BLOCKS)
        hs = cached[s:s + CACHED_BLOCKS] + [h(next(fresh)) for _ in range(PROMPT_BLOCKS - CACHED_BLOCKS)]
        return encode(w.acquire(hs, write=True, reuse=True, request_id=f"r{k}"))

    warm = [prompt(-k) for k in range(1, 1 + min(256, n // 20))]
    acq = [prompt(k) for k in range(n)]
    # and some sent one at a time: the latency without queueing
    serial = [prompt(n + k) for k in range(200)]   # ~0.3 s; fewer gave a p50 that moved with a handful of samples
    s = w.subjects

    async def leases(payloads: list[bytes], inflight: int = inflight) -> tuple[float, list[float], list[LeaseGrant]]:
        wall, lat, replies = await drive(nc, s.request("acquire", w.worker_id), payloads, inflight, recover=w.recover)
        grants = [decode(r) for r in replies]
        bad = [g for g in grants if not isinstance(g, LeaseGrant)]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(grants)} acquires refused, e.g. {bad[0]}")
        return wall, lat, grants

    async def releases(grants: list[LeaseGrant]) -> tuple[float, list[float], list[bytes]]:
        payloads = [encode(w.release(g.lease_id)) for g in grants]
        wall, lat, replies = await drive(nc, s.request("release", w.worker_id), payloads, inflight, recover=w.recover)
        bad = [r for r in map(decode, replies) if not isinstance(r, LeaseReleased)]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(replies)} releases refused, e.g. {bad[0]}")
        return wall, lat, payloads

    _log(f"leases: warm-up ({len(warm)} acquire + release) ...")
    _, _, wg = await leases(warm)
    g0 = wg[0]
    if g0.usable_blocks != CACHED_BLOCKS or len(g0.write.get("compressed", [])) != PROMPT_BLOCKS - CACHED_BLOCKS:
        raise RuntimeError(f"unexpected grant shape: usable {g0.usable_blocks}, write {g0.write}")
    _, _, wrel = await releases(wg)
    grant_bytes = round(statistics.fmean(len(encode(g)) for g in wg))
    rel_reply_bytes = len(encode(LeaseReleased(lease_id=g0.lease_id)))

    echo_subj = {"acq": f"{s.prefix}.echo.acquire", "rel": f"{s.prefix}.echo.release"}
    echo = EchoProc(nats_url, {
        echo_subj["acq"]: grant_bytes, echo_subj["rel"]: rel_reply_bytes})
    try:
        await drive(nc, echo_subj["acq"], warm, inflight)
        _log(f"leases: echo baseline, {n} requests, {inflight} in flight ...")
        echo_cpu0 = process_cpu(echo.popen.pid)
        e1 = await drive(nc, echo_subj["acq"], acq, inflight)
        echo_cpu = process_cpu(echo.popen.pid) - echo_cpu0
        _log(f"leases: echo {n / e1[0]:,.0f}/s; now {n} LeaseAcquire ({PROMPT_BLOCKS} blocks, {CACHED_BLOCKS} "
             f"cached), {inflight} in flight ...")
        st0 = await coord.append_stats()
        snaps0 = await coord.snapshots()
        with coord.spy("lease"):
            cpu0 = cpu_seconds(coord.pid)
            lw, ll, grants = await leases(acq)
            cpu = cpu_delta(cpu0, cpu_seconds(coord.pid), n, "lease")
        appends = append_delta(st0, await coord.append_stats(), "lease")
        # a snapshot freezes the ledger while it serialises the state: count those in the timed run
        appends["lease_snapshots"] = round(await coord.snapshots() - snaps0)
        ls = rate_summary(n, lw, ll)
        _log(f"leases: acquire {ls['per_s']:,.0f}/s, p50 {ls['p50_ms']:.2f} ms, p99 {ls['p99_ms']:.2f} ms; "
             f"{appends}; {cpu}")
        e2 = await drive(nc, echo_subj["acq"], acq, inflight)
        _log(f"leases: echo (again) {n / e2[0]:,.0f}/s")
        # One request at a time: the latency without queueing (group commit window + fsync).
        _, sel, _ = await drive(nc, echo_subj["acq"], serial, 1)
        _, sll, sgrants = await leases(serial, 1)
        await releases(sgrants)
        _log(f"leases: one in flight: acquire p50 {1000 * pct(sll, 0.5):.2f} ms, p99 {1000 * pct(sll, 0.99):.2f} ms "
             f"(echo p50 {1000 * pct(sel, 0.5):.2f} ms)")

        rel_payloads = [encode(w.release(g.lease_id)) for g in grants]
        await drive(nc, echo_subj["rel"], wrel, inflight)
        r1 = await drive(nc, echo_subj["rel"], rel_payloads, inflight)
        rw, rl, _ = await releases(grants)
        rs = rate_summary(n, rw, rl)
        r2 = await drive(nc, echo_subj["rel"], rel_payloads, inflight)
        _log(f"leases: release {rs['per_s']:,.0f}/s (echo {n / r1[0]:,.0f}/s, {n / r2[0]:,.0f}/s)")
    finally:
        echo.stop()

    es = rate_summary(2 * n, e1[0] + e2[0], e1[1] + e2[1])
    ers = rate_summary(2 * n, r1[0] + r2[0], r1[1] + r2[1])
    return {
        "lease_requests": n, "lease_inflight": inflight, "lease_blocks": PROMPT_BLOCKS,
        "lease_cached_blocks": CACHED_BLOCKS,
        "lease_request_bytes": round(statistics.fmean(map(len, acq))), "lease_reply_bytes": grant_bytes,
        "lease_per_s": round(ls["per_s"]), "lease_p50_ms": round(ls["p50_ms"], 3),
        "lease_p99_ms": round(ls["p99_ms"], 3), "lease_mean_ms": round(ls["mean_ms"], 3),
        "echo_per_s": round(es["per_s"]), "echo_per_s_before": round(n / e1[0]),
        "echo_per_s_after": round(n / e2[0]), "echo_p50_ms": round(es["p50_ms"], 3),
        "echo_p99_ms": round(es["p99_ms"], 3), "echo_cpu_us_per_op_responder": round(1e6 * echo_cpu / n, 1),
        "lease_ratio_vs_echo": round(ls["per_s"] / es["per_s"], 3),
        "release_per_s": round(rs["per_s"]), "release_p50_ms": round(rs["p50_ms"], 3),
        "release_p99_ms": round(rs["p99_ms"], 3), "release_echo_per_s": round(ers["per_s"]),
        "release_ratio_vs_echo": round(rs["per_s"] / ers["per_s"], 3),
        "lease_serial_p50_ms": round(1000 * pct(sll, 0.5), 3), "lease_serial_p99_ms": round(1000 * pct(sll, 0.99), 3),
        "echo_serial_p50_ms": round(1000 * pct(sel, 0.5), 3), "echo_serial_p99_ms": round(1000 * pct(sel, 0.99), 3),
        **appends, **cpu,
    }


# --- phase (c): replay and restart --------------------------------------------------------------

class LogBuilder:
    """A legal log made by the real core commands, one simulated request at a time.

    Each request: a 32-block prompt; half of them share a prefix (8–24 blocks) with one of
    the last 8 prompts (read pins), the rest of the blocks are written (write grant, LRU
    eviction once the 512-slot pool is full, commit transitions through the worker
    transition path), then the lease is released. A heartbeat every simulated second (answered
    by the core with no event: heartbeats are soft state, so the log holds none).

    The pool is small (512 slots) so that it is full after a few requests, and the workload is
    then the steady state of a busy worker: every block a grant writes evicts one (the victims
    come from the pool's LRU index). The log is ~92% commit transitions; each grant carries its
    victims, pins and allocations.
    """

    def __init__(self, params: Any, *, pool_slots: int = 512, prompt_blocks: int = 32, seed: int = 3) -> None:
        from coordinator import core
        from shared import messages
        self.core, self.m = core, messages
        self.state = core.LedgerState.empty(params)
        self.rng = random.Random(seed)
        self.pool_slots = pool_slots
        self.prompt_blocks = prompt_blocks
        self.now = self.last_heartbeat = messages.now_ms() - 3_600_000
        self.epoch = 0
        self.seq = 0
        self.next_block = 1
        self.requests = 0
        self.recent: deque[list[str]] = deque(maxlen=8)
        self.worker = "replayw"

    def _apply(self, events: list[Any]) -> list[Any]:
        apply = self.core.apply
        for e in events:
            apply(self.state, e)
        return events

    def start(self) -> list[Any]:
        reply, evs = self.core.register_worker(self.state, self.m.WorkerRegister(
            worker_id=self.worker, namespace=NS, catalogue=catalogue(),
            pool_slots={"compressed": self.pool_slots}), self.now)
        self.epoch = reply.epoch
        return self._apply(evs)

    def request(self) -> list[Any]:
        core, m = self.core, self.m
        out: list[Any] = []
        self.requests += 1
        self.now += 3
        if self.now - self.last_heartbeat >= 1000:
            self.last_heartbeat = self.now
            _, evs = core.heartbeat(self.state, m.Heartbeat(worker_id=self.worker, epoch=self.epoch), self.now)
            out += self._apply(evs)
        n = self.prompt_blocks
        if self.recent and self.rng.random() < 0.5:
            base = self.rng.choice(self.recent)
            k = self.rng.randint(8, 24)
            hashes = base[:k]
        else:
            hashes = []
        while len(hashes) < n:
            hashes.append(h(self.next_block))
            self.next_block += 1
        self.recent.append(hashes)
        lease_id = f"l{self.requests:015x}"
        reply, evs = core.acquire_lease(self.state, m.LeaseAcquire(
            worker_id=self.worker, epoch=self.epoch, request_id=f"q{self.requests}", namespace=NS,
            block_hashes=hashes, write_forms=["compressed"], reuse=True), self.now, lease_id)
        if not isinstance(reply, m.LeaseGrant):
            raise RuntimeError(f"log builder: acquire refused: {reply}")
        out += self._apply(evs)
        self.now += 1
        for i in reply.write.get("compressed", []):
            self.seq += 1
            t = commit_transition(self.epoch, self.seq, hashes, i, lease_id, self.now, self.worker)
            out += self._apply(core.ingest_transition(self.state, t, self.now))
        self.now += 1
        _, evs = core.release_lease(self.state, m.LeaseRelease(worker_id=self.worker, epoch=self.epoch,
                                                               lease_id=lease_id), self.now)
        return out + self._apply(evs)


async def build_log(db_url: str, n: int, tail: int, pool_slots: int = 512) -> dict[str, Any]:
    """Write a ~``n``-event log (and a snapshot ``tail`` events before its end) into ``db_url``;
    the simulated worker has ``pool_slots`` slots."""
    import asyncpg

    from coordinator.core import CoreParams, state_hash, to_snapshot
    from coordinator.core.lifecycle import LIVE
    from coordinator.ledger import to_new_event
    from coordinator.log.migrate import upgrade
    from coordinator.log.postgres import PgSettings, create_engine

    engine = create_engine(PgSettings(url=db_url))
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()
    b = LogBuilder(CoreParams(), pool_slots=pool_slots)
    heads: dict[str, int] = {}
    chain = [GENESIS]   # the log's chain head (coordinator.log.chain), as the coordinator's writer keeps it
    counts: dict[str, int] = {}
    snap: list[Any] = []
    first = b.start()
    pos = 0

    def generate(limit: int) -> list[tuple[Any, ...]]:
        """The next events (whole requests) up to ``limit`` in all, as COPY rows; takes the snapshot."""
        nonlocal first
        rows: list[tuple[Any, ...]] = []
        at = pos
        while at < limit:
            if not snap and at >= n - tail:
                snap.extend((at, state_hash(b.state), to_snapshot(b.state), len(b.state.replicas),
                             sum(r.state in LIVE for r in b.state.replicas.values()), chain[0]))
            for e in first or b.request():
                ne = to_new_event(e)
                v = heads.get(ne.stream_id, 0) + 1
                heads[ne.stream_id] = v
                counts[ne.type] = counts.get(ne.type, 0) + 1
                at += 1
                chain[0] = link(chain[0], at, 1, ne.stream_id, ne.type, ne.source_id, ne.payload)
                rows.append((at, ne.stream_id, v, ne.source_id, ne.type, ne.payload.decode(), 1, chain[0]))
            first = []
        return rows

    conn = await asyncpg.connect(db_url)
    t0 = time.perf_counter()
    try:
        await conn.execute("UPDATE leader SET leader_epoch = 1, holder = 'bench.coordinator log builder'")
        # The core generates the next chunk (in a thread) while the previous one is copied in.
        chunk = 25_000
        copying: asyncio.Task[Any] | None = None
        while pos < n:
            rows = await asyncio.to_thread(generate, min(pos + chunk, n))
            if copying is not None:
                await copying
            pos += len(rows)
            copying = asyncio.create_task(conn.copy_records_to_table("events", records=rows, columns=COLUMNS))
            if pos % 100_000 < chunk or pos >= n:
                _log(f"replay: log at {pos:,} events ({pos / (time.perf_counter() - t0):,.0f}/s generated and copied)")
        if copying is not None:
            await copying
        build_s = time.perf_counter() - t0
        await conn.execute("INSERT INTO snapshots (position, state_hash, state, leader_epoch, chain_hash) "
                           "VALUES ($1, $2, $3, 1, $4)", *snap[:3], snap[5])
        await conn.execute("ANALYZE events")
    finally:
        await conn.close()
    return {"events": pos, "state_hash": state_hash(b.state), "snapshot_position": snap[0],
            "snapshot_bytes": len(snap[2]), "snapshot_replicas": snap[3], "snapshot_live_replicas": snap[4],
            "requests": b.requests, "replicas": len(b.state.replicas),
            "build_per_s": pos / build_s, "mix": {k: round(v / pos, 3) for k, v in sorted(counts.items())}}


async def read_payloads(db_url: str, n: int) -> list[bytes]:
    """The log's ``n`` payloads, in position order."""
    import asyncpg
    conn = await asyncpg.connect(db_url)
    try:
        rows = await conn.fetch("SELECT convert_to(payload, 'UTF8') FROM events ORDER BY position")
    finally:
        await conn.close()
    assert len(rows) == n, (len(rows), n)
    return [r[0] for r in rows]


async def read_baseline(db_url: str, n: int) -> float:
    """Seconds to read the log's rows as load_state does (the same statement, columns and pages,
    one page after another), raw asyncpg."""
    import asyncpg

    from coordinator.log.postgres import READ_PAYLOADS
    from coordinator.replay import REPLAY_PAGE
    page = REPLAY_PAGE
    conn = await asyncpg.connect(db_url)
    q = READ_PAYLOADS
    try:
        stmt = await conn.prepare(q)
        t0 = time.perf_counter()
        pos, got = 0, 0
        while True:
            rows = await stmt.fetch(pos + 1, page)
            if not rows:
                break
            got += len(rows)
            pos = rows[-1][0]
        dt = time.perf_counter() - t0
    finally:
        await conn.close()
    assert got == n, (got, n)
    return dt


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    from shared.embedded import start_services
    from shared.subjects import Subjects

    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="kvl-bench-coordinator-"))
    db_url, nats_url = args.database_url, args.nats_url
    services = None
    result: dict[str, Any] = {"quick": args.quick}
    dbs: list[str] = []
    procs: list[CoordinatorProc] = []
    streams: list[str] = []
    nc = None
    worker: BenchWorker | None = None
    t_start = time.perf_counter()
    phase_s: dict[str, float] = {}
    ok = False
    try:
        if not (db_url and nats_url):
            _log("starting embedded PostgreSQL and/or NATS ...")
            services = await asyncio.to_thread(start_services, db_url, nats_url, str(tmp / "services"))
            db_url, nats_url = services.database_url, services.nats_url
        result["services"] = "embedded" if services is not None and (services.postgres or services.nats) else "given"
        result.update(await pg_facts(db_url))
        nc = await nats.connect(nats_url, name="bench.coordinator")
        phases = set(args.only.split(",")) if args.only else set(PHASES)
        if phases - set(PHASES):
            raise SystemExit(f"--only: unknown phase(s) {sorted(phases - set(PHASES))}; known: {','.join(PHASES)}")

        if phases & {"ingest", "leases"}:
            t0 = time.perf_counter()
            live_db, name = await create_db(db_url, "live")
            dbs.append(name)
            subjects = Subjects(f"kvlbench{uuid.uuid4().hex[:8]}")
            streams.append(subjects.stream_name)
            coord = CoordinatorProc(tmp, "live", live_db, nats_url, subjects.prefix,
                                    {k: v for k, v in (("gc_young_threshold", args.gc_young_threshold),
                                                       ("gc_full_threshold", args.gc_full_threshold),
                                                       ("decide_pass_max", args.decide_pass_max)) if v} or None,
                                    database=None if args.copy_append_min_events is None
                                    else {"copy_append_min_events": args.copy_append_min_events})
            procs.append(coord)
            _log(f"starting the coordinator (fresh database {name}, prefix {subjects.prefix}) ...")
            coord.start()
            empty_s, _ = await coord.wait_ready()
            result["start_empty_to_ready_s"] = round(empty_s, 3)
            from shared.config import CoordinatorConfig
            result["coordinator_gc_young_threshold"] = args.gc_young_threshold or CoordinatorConfig().gc_young_threshold
            result["coordinator_gc_full_threshold"] = args.gc_full_threshold or CoordinatorConfig().gc_full_threshold
            result["coordinator_decide_pass_max"] = args.decide_pass_max or CoordinatorConfig().decide_pass_max
            from shared.config import DatabaseConfig
            result["coordinator_copy_append_min_events"] = (DatabaseConfig().copy_append_min_events
                                                            if args.copy_append_min_events is None
                                                            else args.copy_append_min_events)
            _log(f"coordinator ready in {empty_s:.2f} s (empty log, schema created)")
            n_ingest = args.ingest if "ingest" in phases else 4 * CACHED_BLOCKS * 64
            worker = BenchWorker(nc, subjects, slots=3 * n_ingest + 10_000 + 20 * args.leases * PROMPT_BLOCKS + 1000)
            await worker.register()
            phase_s["start"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            ing = await ingest_phase(nc, nats_url, coord, worker, live_db, n_ingest)
            cached = ing.pop("_hashes")
            if "ingest" in phases:
                result.update(ing)
                result.update(await backlog_phase(nc, coord, worker, n_ingest, ing["copy_rows_per_s"]))
            phase_s["ingest"] = time.perf_counter() - t0
            if "leases" in phases:
                t0 = time.perf_counter()
                slots, grants = FULL_POOL[args.quick]
                _log(f"leases: a 16-block write grant on a full pool of {slots:,} slots (the core alone) ...")
                fp = await asyncio.to_thread(full_pool_phase, slots, grants)
                _log(f"leases: full pool: {fp['grant_full_pool_us']} us per grant with the LRU index, "
                     f"{fp['grant_full_pool_scan_us']} us to scan the pool for the same victims; a resume "
                     f"holding all {fp['resume_full_pool_replicas']:,} replicas: {fp['resume_full_pool_ms']} ms")
                result.update(fp)
                result.update(await lease_phase(nc, nats_url, coord, worker, cached, args.leases, args.inflight,
                                                n_ingest + 1))
                phase_s["leases"] = time.perf_counter() - t0
            if "ingest" in phases:
                t0 = time.perf_counter()
                result.update(await ingest_compare_phase(nc, nats_url, coord, worker, n_ingest // 5,
                                                         min(n_ingest // 10, 10_000), ing["ingest_events_per_s"],
                                                         ing["copy_rows_per_s"]))
                phase_s["ingest_compare"] = time.perf_counter() - t0
            worker.stop()
            coord.stop()
            # A leader that lost its lock stepped down and replayed the log mid-measurement: say so.
            result["leadership_losses"] = coord.log_events("leadership_lost")
            if result["leadership_losses"]:
                _log(f"WARNING: the coordinator lost leadership {result['leadership_losses']} time(s) during the "
                     "run (see docs/BENCHMARKS.md); its figures include the takeovers")
            if coord.popen is not None and coord.popen.returncode not in (0, None):
                _log(f"coordinator exited with {coord.popen.returncode}:\n{coord.tail()}")

        if "idle" in phases:
            t0 = time.perf_counter()
            result.update(await idle_phase(nc, db_url, nats_url, tmp, dbs, procs, streams, args.idle_workers,
                                           args.idle_seconds, args.idle_heartbeat_ms))
            phase_s["idle"] = time.perf_counter() - t0

        if "replay" in phases:
            t0 = time.perf_counter()
            result.update(await replay_and_restart(nc, db_url, nats_url, tmp, args.replay_events, dbs, procs,
                                                   streams, args.takeover_rounds, args.replay_pool_slots,
                                                   args.replay_repeats))
            phase_s["replay"] = time.perf_counter() - t0
        ok = True
    except BaseException:
        for p in procs:
            if p.popen is not None:
                _log(f"--- {p.name} coordinator log (tail) ---\n{p.tail()}")
        _log(f"coordinator logs and state kept in {tmp}")
        raise
    finally:
        if worker is not None:
            worker.stop()
        for p in procs:
            p.stop()
        if nc is not None:
            js = nc.jetstream(timeout=10)
            for stream in streams:
                try:
                    await js.delete_stream(stream)
                except Exception as e:  # noqa: BLE001 - best effort, say so
                    _log(f"could not delete JetStream stream {stream}: {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                await nc.close()
        for name in dbs:
            try:
                await drop_db(db_url, name)
            except Exception as e:  # noqa: BLE001 - best effort, say so
                _log(f"could not drop database {name}: {e}")
        if services is not None:
            await asyncio.to_thread(services.stop)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
    if "restart_to_ready_s" in result and "start_empty_to_ready_s" in result:
        result["restart_ratio_vs_empty_start"] = round(
            result["restart_to_ready_s"] / result["start_empty_to_ready_s"], 3)
    result["goals"] = goals(result)
    result["phase_s"] = {k: round(v, 1) for k, v in phase_s.items()}
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    result["load_avg_start"] = [round(x, 2) for x in load0]
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["cpus"] = os.cpu_count()
    return result


#: The issues' goals: (figure, comparison, bound). A bound ``(key, factor)`` is that figure of the
#: same run times ``factor`` (a ratio to a baseline measured alongside).
GOALS: tuple[tuple[str, str, Any], ...] = (
    ("lease_serial_p50_ms", "<=", ("echo_serial_p50_ms", 3)), ("lease_ratio_vs_echo", ">=", 0.4),
    ("lease_p99_ms", "<=", ("echo_p99_ms", 5)), ("ingest_ratio_vs_copy", ">=", 0.5),
    ("replay_seconds_per_1m", "<=", 4.0), ("replay_ratio_vs_read", ">=", 0.8),
    ("restart_to_ready_s", "<=", 2.0), ("snapshot_bytes", "<=", 1_000_000),
    ("takeover_to_ready_s", "<=", 2.0), ("idle_events_per_worker_per_hour", "<=", 10.0),
)


def goals(result: dict[str, Any]) -> dict[str, bool]:
    """``{"<figure> <op> <bound>": met}`` for each goal whose figure this run measured."""
    out = {}
    for k, op, bound in GOALS:
        if isinstance(bound, tuple):
            base, factor = bound
            if k not in result or base not in result:
                continue
            name, limit = f"{k} {op} {factor} x {base}", factor * result[base]
        else:
            if k not in result:
                continue
            name, limit = f"{k} {op} {bound}", bound
        out[name] = result[k] >= limit if op == ">=" else result[k] <= limit
    return out


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


async def replay_and_restart(nc: Any, base_url: str, nats_url: str, tmp: Path, n: int, dbs: list[str],
                             procs: list[CoordinatorProc], streams: list[str], takeover_rounds: int,
                             pool_slots: int = 512, repeats: int = 1) -> dict[str, Any]:
    from coordinator.core import CoreParams, decode_event, replay, state_hash
    from coordinator.log.postgres import PgSettings, PostgresEventLog
    from coordinator.replay import load_state
    from shared.subjects import Subjects

    db_url, name = await create_db(base_url, "replay")
    dbs.append(name)
    tail = max(n // 50, 1000)
    _log(f"replay: building a {n:,}-event log with the core commands (snapshot {tail:,} events before the end) ...")
    built = await build_log(db_url, n, tail, pool_slots)
    n = built["events"]

    log = PostgresEventLog.connect(PgSettings(url=db_url))
    try:
        # NOTE: the read baseline and the replay alternate ``repeats`` times and each key is the
        # median: on this VM one run of either moved by up to a third between minutes.
        reads, replays = [], []
        for k in range(repeats):
            _log(f"replay: baseline: read the same rows, same columns and pages, raw asyncpg (no decode, "
                 f"no fold) ({k + 1}/{repeats}) ...")
            reads.append(await read_baseline(db_url, n))
            _log(f"replay: read {n / reads[-1]:,.0f} rows/s; coordinator.replay.load_state from empty over "
                 f"{n:,} events ...")
            res = await load_state(log, CoreParams(), use_snapshot=False)
            replays.append(res.seconds)
            if res.events != n or state_hash(res.state) != built["state_hash"]:
                raise RuntimeError(f"replay disagrees with the builder: {res.events} events, "
                                   f"hash {state_hash(res.state)}")
            del res
            _log(f"replay: {n:,} events in {replays[-1]:.2f} s: {n / replays[-1]:,.0f} events/s (state hash matches)")
        t_read, t_replay = statistics.median(reads), statistics.median(replays)
        res = await load_state(log, CoreParams())
        t_snap = res.seconds
        assert res.snapshot_position == built["snapshot_position"]
        del res
        _log(f"replay: from the snapshot + {n - built['snapshot_position']:,}-event tail in {t_snap:.2f} s")
    finally:
        await log.close()

    # The fold alone: decode + apply of the same events from memory (no PostgreSQL, no paging).
    # NOTE: read back after the timed replays, not kept from the build: a million payloads held
    # through them (~0.7 GB) slowed the replay by a tenth, a cost no coordinator pays.
    payloads = await read_payloads(db_url, n)

    def fold() -> float:
        t0 = time.perf_counter()
        replay((decode_event(p) for p in payloads), CoreParams())
        return time.perf_counter() - t0
    t_fold = await asyncio.to_thread(fold)
    _log(f"replay: pure fold (decode + apply, in memory) {n / t_fold:,.0f} events/s")
    del payloads

    subjects = Subjects(f"kvlbench{uuid.uuid4().hex[:8]}")
    streams.append(subjects.stream_name)
    coord = CoordinatorProc(tmp, "restart", db_url, nats_url, subjects.prefix)
    procs.append(coord)
    _log("restart: starting a coordinator process on that log ...")
    coord.start()
    restart_s, body = await coord.wait_ready()
    lr = body.get("last_replay", {})
    _log(f"restart: ready in {restart_s:.2f} s (snapshot at {lr.get('snapshot_position')}, "
         f"{lr.get('events')} events replayed in {lr.get('seconds')} s)")
    # That coordinator now leads on the log: a standby takes over when it is killed (and so on).
    last, takeover = await takeover_phase(nc, coord, db_url, nats_url, tmp, subjects, procs, takeover_rounds)
    last.stop()
    return {
        "replay_events": n, "replay_pool_slots": pool_slots, "replay_repeats": repeats,
        "replay_seconds_each": [round(t, 3) for t in replays], "replay_seconds": round(t_replay, 3), "replay_events_per_s": round(n / t_replay),
        "replay_read_rows_per_s": round(n / t_read), "replay_ratio_vs_read": round(t_read / t_replay, 3),
        "replay_fold_events_per_s": round(n / t_fold),
        "replay_seconds_per_1m": round(t_replay * 1e6 / n, 3),
        "replay_from_snapshot_s": round(t_snap, 3),
        "replay_log_mix": built["mix"], "replay_log_requests": built["requests"],
        "replay_state_replicas": built["replicas"], "replay_log_build_events_per_s": round(built["build_per_s"]),
        "replay_us_per_request": round(1e6 * t_replay / built["requests"], 1),
        "snapshot_position": built["snapshot_position"], "snapshot_bytes": built["snapshot_bytes"],
        "snapshot_replicas": built["snapshot_replicas"], "snapshot_live_replicas": built["snapshot_live_replicas"],
        "restart_to_ready_s": round(restart_s, 3), "restart_history_events": n, "restart_tail_events": lr.get("events"),
        "restart_replay_s": lr.get("seconds"),
        **takeover, "takeover_baseline_restart_to_ready_s": round(restart_s, 3),
        "takeover_ratio_vs_restart": round(takeover["takeover_to_ready_s"] / restart_s, 3),
    }


# --- takeover: a hot standby on the same log --------------------------------------------------

#: Blocks the takeover phase's worker commits: the cache it resumes with after the takeover.
TAKEOVER_BLOCKS = 256
#: Block numbers of the takeover worker's cached and new blocks (apart from the log builder's).
TAKEOVER_BLOCK0, TAKEOVER_FRESH0 = 1 << 40, 1 << 41
#: Seconds of lease traffic the leader serves (and the standby follows) before it is killed.
TAKEOVER_LOAD_S = 2.0
#: The churning worker's request timeout: a request in flight when the leader dies is never
#: answered, so this bounds ``takeover_first_grant_s`` from below in that case (a worker's
#: default, ``nats.request_timeout_ms``, is 2 s).
TAKEOVER_REQUEST_TIMEOUT_S = 0.5


async def commit_blocks(nc: Any, w: BenchWorker, hashes: list[str]) -> None:
    """Fill ``hashes`` as a worker would: a write lease, one commit transition per block through
    JetStream, the commit watermark, then the release; the worker then holds them READY."""
    from shared.messages import LeaseGrant, encode, now_ms
    g = await w.request(w.subjects.request("acquire", w.worker_id), w.acquire(hashes, write=True, reuse=False))
    if not isinstance(g, LeaseGrant) or g.write.get("compressed") != list(range(len(hashes))):
        raise RuntimeError(f"setup lease refused or partial: {g}")
    js = nc.jetstream(timeout=30)
    ts = now_ms()
    pairs = []
    for i in range(len(hashes)):
        w.emitted_seq += 1
        t = commit_transition(w.epoch, w.emitted_seq, hashes, i, g.lease_id, ts, w.worker_id)
        await js.publish(w.subjects.events(w.worker_id), encode(t), headers={"Nats-Msg-Id": t.source_id})
        pairs.append((hashes[i], w.emitted_seq))
    await w.wait_watermark(w.emitted_seq, 60)
    w.note_committed(pairs)
    await w.request(w.subjects.request("release", w.worker_id), w.release(g.lease_id))


async def churn(w: BenchWorker, cached: list[str], stop: asyncio.Event, grants: list[tuple[float, float]]) -> int:
    """Until ``stop``: one lease at a time (12 cached blocks read, 4 new ones written), then its
    release (the writes abort). ``grants`` gets (sent, answered) perf_counter times of each
    grant; returns how many requests got no answer or no grant (nobody answering during the
    takeover; a request in flight at the kill waits for the timeout, TAKEOVER_REQUEST_TIMEOUT_S)."""
    from shared.messages import LeaseGrant
    rng = random.Random(11)
    misses, k = 0, 0
    while not stop.is_set():
        k += 1
        s = rng.randrange(0, len(cached) - CACHED_BLOCKS)
        hs = cached[s:s + CACHED_BLOCKS] + [h(TAKEOVER_FRESH0 + (PROMPT_BLOCKS - CACHED_BLOCKS) * k + j)
                                            for j in range(PROMPT_BLOCKS - CACHED_BLOCKS)]
        t0 = time.perf_counter()
        try:
            g = await w.request(w.subjects.request("acquire", w.worker_id), w.acquire(hs, write=True, reuse=True, request_id=f"t{k}"),
                                timeout=TAKEOVER_REQUEST_TIMEOUT_S)
        except (RuntimeError, asyncio.CancelledError):
            raise
        except Exception:  # noqa: BLE001 - no responders (nobody leads yet) or the leader died mid-request
            g = None
        if not isinstance(g, LeaseGrant):
            misses += 1
            await asyncio.sleep(0.01)
            continue
        grants.append((t0, time.perf_counter()))
        try:
            await w.request(w.subjects.request("release", w.worker_id), w.release(g.lease_id), timeout=TAKEOVER_REQUEST_TIMEOUT_S)
        except (RuntimeError, asyncio.CancelledError):
            raise
        except Exception:  # noqa: BLE001 - as above; the lease then stays until the worker's resume or its TTL
            misses += 1
    return misses


async def takeover_phase(nc: Any, leader: CoordinatorProc, db_url: str, nats_url: str, tmp: Path, subjects: Any,
                         procs: list[CoordinatorProc], rounds: int) -> tuple[CoordinatorProc, dict[str, Any]]:
    """``rounds`` times: a standby coordinator (same database, same prefix) follows the leader's
    log; the leader, serving one lease at a time, is killed (SIGKILL): seconds until the
    standby's ``/readyz`` 200; the standby is the next round's leader. The bench worker resumes
    its suspended epoch after each takeover with the digests of what it committed.
    Returns the last leader (still running) and the figures (``takeover_to_ready_s``: the slowest round)."""
    w = BenchWorker(nc, subjects, slots=4096, worker_id="benchtk")
    await w.register()
    load: asyncio.Task[int] | None = None
    runs: list[dict[str, Any]] = []
    try:
        cached = [h(TAKEOVER_BLOCK0 + i) for i in range(TAKEOVER_BLOCKS)]
        await commit_blocks(nc, w, cached)
        for rnd in range(1, rounds + 1):
            position = (await leader.readyz())["position"]
            standby = CoordinatorProc(tmp, f"standby{rnd}", db_url, nats_url, subjects.prefix)
            procs.append(standby)
            _log(f"takeover {rnd}/{rounds}: starting a standby coordinator on the same database and prefix "
                 f"(log at {position:,}) ...")
            standby.start()
            follow_s, _ = await standby.wait_standby(position)
            _log(f"takeover {rnd}/{rounds}: standby following the log after {follow_s:.2f} s; {TAKEOVER_LOAD_S:g} s "
                 "of leases (one at a time) on the leader, then SIGKILL ...")
            stop = asyncio.Event()
            grants: list[tuple[float, float]] = []
            load = asyncio.create_task(churn(w, cached, stop, grants))
            await asyncio.sleep(TAKEOVER_LOAD_S)
            before = len(grants)
            t_kill = leader.kill()
            ready_s, body = await standby.wait_ready(timeout_s=120, since=t_kill)
            lr = body.get("last_replay") or {}
            _log(f"takeover {rnd}/{rounds}: standby ready {ready_s:.3f} s after the kill (leader epoch "
                 f"{body.get('leader_epoch')}; caught up {lr.get('events')} events in {lr.get('seconds')} s"
                 + (f", FROM THE SNAPSHOT at {lr['snapshot_position']}" if lr.get("snapshot_position") else "") + ")")
            t_resumed, resumed = await w.wait_resumed(t_kill, timeout_s=60)
            deadline = time.monotonic() + 60
            while not any(sent > t_kill for sent, _ in grants):
                if load.done() or time.monotonic() > deadline:
                    why = load.exception() if load.done() else "none within 60 s"
                    raise RuntimeError(f"no lease granted after the takeover: {why}")
                await asyncio.sleep(0.01)
            first_grant = min(done for sent, done in grants if sent > t_kill) - t_kill
            stop.set()
            misses = await load
            load = None
            _log(f"takeover {rnd}/{rounds}: worker resumed {t_resumed - t_kill:.3f} s after the kill (kept "
                 f"{resumed.kept} of {len(w.committed)} replicas), first lease from the new leader "
                 f"{first_grant:.3f} s after it")
            if resumed.kept != len(w.committed):
                _log(f"WARNING: the resume kept {resumed.kept} replicas, the worker holds {len(w.committed)}")
            runs.append({"ready_s": ready_s, "caught_up": lr.get("events"), "catch_up_s": lr.get("seconds"),
                         "from_snapshot": bool(lr.get("snapshot_position")), "follow_s": follow_s,
                         "load_per_s": before / TAKEOVER_LOAD_S, "misses": misses,
                         "resumed_s": t_resumed - t_kill, "first_grant_s": first_grant, "kept": resumed.kept,
                         "dropped": len(resumed.drop) // 8})
            leader = standby
    finally:
        w.stop()
        if load is not None and not load.done():
            load.cancel()
            with contextlib.suppress(BaseException):
                await load
    worst = max(runs, key=lambda r: r["ready_s"])

    def each(k: str, nd: int = 3) -> list[Any]:
        return [round(r[k], nd) if isinstance(r[k], float) else r[k] for r in runs]
    return leader, {
        "takeover_rounds": rounds, "takeover_to_ready_s": round(worst["ready_s"], 3),
        "takeover_to_ready_s_each": each("ready_s"),
        "takeover_caught_up_events": worst["caught_up"], "takeover_caught_up_events_each": each("caught_up"),
        "takeover_catch_up_s_each": each("catch_up_s"), "takeover_catch_up_from_snapshot": each("from_snapshot"),
        "takeover_standby_following_s_each": each("follow_s"), "takeover_load_leases_per_s": each("load_per_s", 1),
        "takeover_unanswered_requests_each": each("misses"), "takeover_worker_resumed_s_each": each("resumed_s"),
        "takeover_first_grant_s_each": each("first_grant_s"), "takeover_resume_held": len(w.committed),
        "takeover_resume_kept_each": each("kept"), "takeover_resume_dropped_each": each("dropped"),
    }


# --- phase (d): idle workers: what liveness costs the log ---------------------------------------

#: The production heartbeat interval the idle figures are scaled to (the config default).
DEFAULT_HEARTBEAT_MS = 1000


def idle_rates(events: int, heartbeats: float, workers: int, window_s: float, interval_ms: int) -> dict[str, float]:
    """Events and heartbeats per worker per hour *at the default 1 s heartbeat interval*, from a
    window of ``window_s`` run at ``interval_ms``.

    Everything the coordinator does for an idle worker is paced by the heartbeat interval (the
    worker's heartbeats, the expiry check, the leader's renewal), so ``window_s`` at ``interval_ms``
    covers as many intervals as ``window_s × 1000 / interval_ms`` seconds at the default:
    ``idle_time_scale`` is that factor. One event per heartbeat gives 3600 per worker per hour."""
    scale = DEFAULT_HEARTBEAT_MS / interval_ms
    worker_hours = workers * window_s * scale / 3600
    return {"idle_events_per_worker_per_hour": round(events / worker_hours, 2),
            "idle_heartbeats_per_worker_per_hour": round(heartbeats / worker_hours, 1),
            "idle_time_scale": round(scale, 3)}


async def idle_phase(nc: Any, base_url: str, nats_url: str, tmp: Path, dbs: list[str], procs: list[CoordinatorProc],
                     streams: list[str], workers: int, window_s: float, interval_ms: int) -> dict[str, Any]:
    """``workers`` registered bench workers heartbeat every ``interval_ms``, holding nothing: events
    appended to the log during ``window_s`` (and heartbeats answered), per worker per hour."""
    import asyncpg

    from shared.subjects import Subjects
    db_url, name = await create_db(base_url, "idle")
    dbs.append(name)
    subjects = Subjects(f"kvlbench{uuid.uuid4().hex[:8]}")
    streams.append(subjects.stream_name)
    coord = CoordinatorProc(tmp, "idle", db_url, nats_url, subjects.prefix,
                            coordinator={"heartbeat_interval_ms": interval_ms})
    procs.append(coord)
    _log(f"idle: coordinator with heartbeat_interval_ms {interval_ms}, {workers} workers ...")
    coord.start()
    await coord.wait_ready()
    ws = [BenchWorker(nc, subjects, slots=64, worker_id=f"benchidle{i}") for i in range(workers)]
    conn = await asyncpg.connect(db_url)
    try:
        for w in ws:
            await w.register()
        await asyncio.sleep(max(1.0, 10 * interval_ms / 1000))  # registrations committed, heartbeats flowing
        last = "SELECT coalesce(max(position), 0) FROM events"

        async def heartbeats() -> tuple[float, float]:
            """Heartbeats the coordinator answered so far: (ok, all outcomes)."""
            hb = [(lb, v) for lb, v in await coord.samples("kvl_coordinator_requests_total")
                  if lb.get("op") == "heartbeat"]
            return sum(v for lb, v in hb if lb.get("outcome") == "ok"), sum(v for _, v in hb)
        p0, (ok0, all0) = await conn.fetchval(last), await heartbeats()
        client0 = sum(w.heartbeats_ok for w in ws)
        t0 = time.perf_counter()
        _log(f"idle: counting events for {window_s:g} s (log at position {p0}) ...")
        await asyncio.sleep(window_s)
        p1, (ok1, all1) = await conn.fetchval(last), await heartbeats()
        states = {lb.get("state", "?"): round(v) for lb, v in await coord.samples("kvl_coordinator_workers")}
        dt = time.perf_counter() - t0
        client = sum(w.heartbeats_ok for w in ws) - client0
        types = {r[0]: r[1] for r in await conn.fetch(
            "SELECT type, count(*) FROM events WHERE position > $1 AND position <= $2 GROUP BY type ORDER BY type",
            p0, p1)}
    finally:
        await conn.close()
        for w in ws:
            w.stop()
        coord.stop()
    events, answered = p1 - p0, ok1 - ok0
    out = idle_rates(events, answered, workers, dt, interval_ms)
    _log(f"idle: {events} events, {answered:.0f} heartbeats answered ({client} seen by the workers, "
         f"{all1 - all0 - answered:.0f} refused) in {dt:.1f} s: {out['idle_events_per_worker_per_hour']} events and "
         f"{out['idle_heartbeats_per_worker_per_hour']} heartbeats per worker per hour at a 1 s interval; {types}")
    return {"idle_workers": workers, "idle_window_s": round(dt, 2), "idle_heartbeat_interval_ms": interval_ms,
            "idle_events": events, "idle_event_types": types, "idle_heartbeats_answered": round(answered),
            "idle_heartbeats_refused": round(all1 - all0 - answered), **out,
            "idle_worker_states": states, "idle_leadership_losses": coord.log_events("leadership_lost")}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(prog="python -m bench.coordinator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs; within 60 s")
    ap.add_argument("--ingest", type=int, help="transitions to ingest (default 100000, quick 10000)")
    ap.add_argument("--leases", type=int, help="lease acquires (default 20000, quick 2000)")
    ap.add_argument("--inflight", type=int, default=64, help="concurrent lease requests (default 64)")
    ap.add_argument("--replay-events", type=int, help="events in the replay log (default 1000000, quick 50000)")
    ap.add_argument("--replay-pool-slots", type=int, default=512,
                    help="the replay log's worker: GPU pool slots (default 512; e.g. 100000 for a large GPU's pool, "
                         "whose state keeps as many tombstones)")
    ap.add_argument("--replay-repeats", type=int, default=3,
                    help="replays of the log from empty, each after a read baseline; the keys are medians (default 3)")
    ap.add_argument("--idle-workers", type=int, help="idle phase: heartbeating workers (default 8, quick 4)")
    ap.add_argument("--idle-seconds", type=float, help="idle phase: counting window (default 30, quick 10)")
    ap.add_argument("--idle-heartbeat-ms", type=int, default=100,
                    help="idle phase: heartbeat interval (default 100; figures are scaled to the default 1000)")
    ap.add_argument("--takeover-rounds", type=int,
                    help="standby takeovers, each of the previous standby (default 3, quick 1)")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(PHASES)} "
                                               "(replay includes the restart and the takeover)")
    ap.add_argument("--gc-young-threshold", type=int,
                    help="the ingest and lease phases' coordinator.gc_young_threshold (default: the config's; "
                         "700 = CPython's own, for an A/B)")
    ap.add_argument("--gc-full-threshold", type=int,
                    help="the ingest and lease phases' coordinator.gc_full_threshold (default: the config's; "
                         "10 = CPython's own, for an A/B)")
    ap.add_argument("--decide-pass-max", type=int,
                    help="the ingest and lease phases' coordinator.decide_pass_max (default: the config's; "
                         "a large value decides a whole burst in one pass, as before stop 50, for an A/B)")
    ap.add_argument("--copy-append-min-events", type=int,
                    help="the ingest and lease phases' database.copy_append_min_events (default: the config's; "
                         "0 = every append by kvl_append, for an A/B)")
    ap.add_argument("--database-url", default=os.environ.get("KVL_DATABASE_URL", ""))
    ap.add_argument("--nats-url", default=os.environ.get("KVL_NATS_URL", ""))
    ap.add_argument("--echo-serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gc_young_threshold is not None and not 100 <= args.gc_young_threshold <= 1_000_000:
        ap.error("--gc-young-threshold must be within 100–1000000 (coordinator.gc_young_threshold)")
    if not 1 <= args.replay_repeats <= 20:
        ap.error("--replay-repeats must be within 1–20")
    if not 64 <= args.replay_pool_slots <= 10_000_000:
        ap.error("--replay-pool-slots must be within 64–10000000 (a request writes up to 32 blocks)")
    if args.gc_full_threshold is not None and not 1 <= args.gc_full_threshold <= 10_000:
        ap.error("--gc-full-threshold must be within 1–10000 (coordinator.gc_full_threshold)")
    if args.decide_pass_max is not None and not 1 <= args.decide_pass_max <= 100_000:
        ap.error("--decide-pass-max must be within 1–100000 (coordinator.decide_pass_max)")
    if args.copy_append_min_events is not None and args.copy_append_min_events < 0:
        ap.error("--copy-append-min-events must be 0 or more (database.copy_append_min_events)")
    if args.echo_serve:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(echo_serve(args.nats_url, args.echo_serve))
        return None
    args.ingest = args.ingest or (10_000 if args.quick else 100_000)
    args.leases = args.leases or (2_000 if args.quick else 20_000)
    args.replay_events = args.replay_events or (50_000 if args.quick else 1_000_000)
    args.idle_workers = args.idle_workers or (4 if args.quick else 8)
    args.takeover_rounds = args.takeover_rounds or (1 if args.quick else 3)
    args.idle_seconds = args.idle_seconds or (10.0 if args.quick else 30.0)
    from bench.cli import run_and_print
    return run_and_print(run(args))


if __name__ == "__main__":
    main()
