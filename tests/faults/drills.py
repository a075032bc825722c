"""The fault drills: each injects one fault into the running stack while conversations run.

Every drill has the same shape. Its name is also its tenant: it labels the drill's requests in
the history, and the drill starts from a cold cache and builds reuse turn by turn. Start the
load, let some requests through, inject the fault, heal it the way an operator or a
supervisor would, measure the recovery — seconds from the injection until a worker answers a
request *with reuse* again (and, where a process restarted, until it was ready) — let the
load run a while longer, stop it, and check the drill's requests: no answer differs from its
cold reference, no conversation gave up, and every failed request failed with an error of a
kind this fault explains. Evidence that the fault really hit the path it aims at (new epochs,
failed disk writes, rejected reloads, refused capacity, 429s) is recorded, and asserted where
the stack must show it.

Control-plane drills (coordinator, standby takeover, NATS, PostgreSQL, stalls, CPU starvation)
also measure **cache retention** on ``wr``, a worker no load touches: a few prompts warmed
before the fault are sent again once the worker and the ledger agree it is back, and the
cached tokens of that first resend ÷ before the fault is ``cache_retained_pct``. A fault
shorter than the resume grace period must keep ≥ 99 %; a stall past the grace and a worker
kill -9 fence the epoch (0 %).

The history over all drills is checked at the end (:func:`final_check`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from shared import messages as m
from shared import nats_auth
from shared.config import parse_config
from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.messages import ReplicaState
from tests.faults import checker
from tests.faults.harness import (
    OFFLOAD_FS_BYTES,
    RESUME_GRACE_MS,
    Observer,
    Stack,
    WorkerSpec,
    fill_fs,
    make_read_only,
    make_writable,
)
from tests.segment_files import cut_inside, flip_header, flip_payload, records, segment_files, torn_tail_bytes
from worker.cache.segments import Record
from tests.faults.workload import (
    Conversation,
    History,
    Load,
    Reference,
    Script,
    ask,
    drill_bytes_scale,
    drill_cache_dtype,
    drill_model,
    probe_prompt,
    probe_reuse,
    rand_tokens,
)

#: Drills in the order the suite runs them (also the tenants that get API keys).
DRILLS = ("coordinator-kill", "log-archive", "standby-takeover", "coordinator-stall", "cpu-starvation", "worker-kill",
          "nats-kill", "postgres-outage", "coordinator-stall-past-grace", "offload-readonly", "offload-damage",
          "offload-full", "pool-exhausted", "spike", "fused-mismatch")
#: Failures a drill's fault explains; anything else fails the drill.
KILLED_WORKER = {"connection refused", "connection reset", "killed mid-request", "nats no responders"}
NATS_DOWN = {"killed mid-request", "nats no responders", "nats disconnected", "nats timeout"}
QUEUE = {"http 429 queue_full", "http 504 queue_timeout"}
#: Fresh 6-block prompts per worker that push older blocks out of wa's and wb's pools.
CHURN = 2
#: How long a worker leaves the disk tier alone after a failed write (worker.cache.tiers.Tiers).
OFFLOAD_RETRY_S = 5.0
#: Prompts (6 blocks each) warmed on wr before a control-plane fault, resent after it.
RETAINED_PROMPTS = 4
#: cache_retained_pct a fault shorter than the resume grace period must reach.
RETENTION_GOAL_PCT = 99.0


#: wa, wb: pools small enough (20 compressed+indexer, 17 tail, 14 window slots) that the drills'
#: tenants push each other's blocks out, so every form is evicted and offloaded to disk.
SMALL_POOLS = {"compressed_pool_limit": 0.1, "tail_pool_limit": 0.15, "swa_pool_limit": 0.5}


#: service.max_concurrency and queue_size of every worker.
MAX_CONCURRENCY = 2
QUEUE_SIZE = 4


#: wb's service.model_lanes and lane_min_rows: every forward of two requests runs as two at once.
LANES = {"model_lanes": 2, "lane_min_rows": 2}


def worker_specs() -> list[WorkerSpec]:
    """wa, wb: ordinary workers with small pools; wa offloads straight to disk, wb through a small
    host tier (~8 window blocks) that spills to disk. wp: one form's pool (``tail``, 2 slots) far
    too small for its load. wr: untouched by the load; it holds the prompts retention is measured on."""
    service = {"max_concurrency": MAX_CONCURRENCY, "queue_size": QUEUE_SIZE}
    return [WorkerSpec("wa", cache=SMALL_POOLS, worker={"pool_bytes": 2**20}, service=service),
            # wb splits every fused forward into two lanes (LANES): the drills' answers and the
            # audit cover that path too
            WorkerSpec("wb", cache={**SMALL_POOLS, "host_tier_bytes": 200_000}, worker={"pool_bytes": 2**20},
                       service={**service, **LANES}),
            pressured_worker(service),
            # the retention witness: no load, no host or disk tier (only its GPU pools can retain)
            WorkerSpec("wr", cache={"host_tier_bytes": 0, "offload_dir": ""}, worker={"pool_bytes": 16 * 2**20},
                       service=service)]


def pressured_worker(service: dict) -> WorkerSpec:
    """wp: the hybrid model's ``tail`` pool cut to 2 slots; a model with one form (a dense
    checkpoint under ``KVL_DRILL_MODEL_DIR``) gets a whole pool that holds 2 blocks of it."""
    if not os.environ.get("KVL_DRILL_MODEL_DIR"):
        return WorkerSpec("wp", cache={"tail_pool_limit": 0.005}, service=service)
    cfg = parse_config({})
    forms = drill_model().form_layouts(cfg.cache.block_size, drill_cache_dtype())
    if "swa" in forms:     # a window form beside full-history ones (YOCO): its pool cut to 2 slots
        from worker.settings import scope_slots
        c = cfg.cache
        budget = 4 * 2**20 * drill_bytes_scale() * cfg.service.cache_reserve_ratio   # the harness's pool_bytes
        specs = [lay.spec for lay in forms.values()]
        share = next(x / 10_000 for x in range(1, 10_000) if scope_slots(specs, budget, {
            FormScope.FULL_HISTORY: c.compressed_pool_limit, FormScope.WINDOW: x / 10_000,
            FormScope.RESUME_POINT: c.tail_pool_limit})["swa"] >= 2)
        return WorkerSpec("wp", cache={"swa_pool_limit": share}, service=service)
    if len(forms) != 1:
        raise AssertionError(f"KVL_DRILL_MODEL_DIR: a model with forms {list(forms)} has no pressure rule here")
    share = cfg.service.cache_reserve_ratio * (cfg.cache.compressed_pool_limit + cfg.cache.swa_pool_limit
                                               + cfg.cache.tail_pool_limit)
    per_block = next(iter(forms.values())).spec.bytes_per_block
    return WorkerSpec("wp", worker={"pool_bytes": int(2.5 * per_block / share)}, service=service)


def pressured_form(forms: dict) -> str:
    return "tail" if "tail" in forms else "swa" if "swa" in forms else next(iter(forms))


def conversations(n: int) -> list[Conversation]:
    """``n`` conversations: the first four on wa and wb over both channels, the fifth hopping
    between them turn by turn, the sixth on wp, more alternating again."""
    base = [Conversation(0, "http", ("wa", "wb")), Conversation(1, "debug", ("wa", "wb")),
            Conversation(2, "http", ("wb", "wa")), Conversation(3, "debug", ("wb", "wa")),
            Conversation(4, "debug", ("wa", "wb"), hop=True), Conversation(5, "debug", ("wp", "wa"))]
    out = base[:n]
    for cid in range(len(base), n):
        out.append(Conversation(cid, "http" if cid % 2 else "debug", ("wa", "wb") if cid % 3 else ("wb", "wa")))
    return out


#: The pool drill's conversations (all on wp).
POOL_CONVERSATIONS = [100, 101, 102]
#: Every drill's load also runs this conversation through the gateway, which picks the worker, as
#: ``n`` = 2 greedy samples per turn (the second decodes a fork of the first one's prompt state;
#: both must equal the cold run):
#: the fault must cost it no error the drill's fault does not explain (a killed worker's requests
#: fail over; a control-plane outage only takes the routing hints away).
GATEWAY_CONVERSATION = Conversation(50, "gateway", ("gateway",))


def churn_prompts() -> list[list[int]]:
    return [rand_tokens(96, "churn", i) for i in range(CHURN)]


def spike_prompts(settings: Settings) -> list[list[int]]:
    """5 × max_concurrency prompts sharing a 3-block stem (so the spike also reuses)."""
    stem = rand_tokens(48, "spike")
    return [stem + rand_tokens(6, "spike", i) for i in range(settings.spike_factor * MAX_CONCURRENCY)]


@dataclass
class Fault:
    drill: str
    injected: str
    at: float                              # run seconds at injection
    ready_s: float | None = None           # until the restarted part was ready
    recovery_s: float | None = None        # until a request with reuse succeeded again
    evidence: dict[str, Any] = field(default_factory=dict)
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0
    not_exercised: str = ""                # the path the drill aims at was not reached (why)
    retained_pct: float | None = None      # cache_retained_pct on wr (control-plane drills)


@dataclass
class Retention:
    prompts: list[list[int]]
    #: Cached tokens the resends got before the fault.
    cached: int


@dataclass
class Settings:
    conversations: int = 4
    turns: int = 3
    coordinator_down_s: float = 1.0
    nats_down_s: float = 1.5
    postgres_down_s: float = 4.0
    stall_s: float = 3.0
    #: CPU starvation: the coordinator gets ``starve_run_ms`` of every ``starve_period_ms`` for ``starve_s``.
    starve_s: float = 6.0
    starve_period_ms: int = 250
    starve_run_ms: int = 50
    spike_factor: int = 5
    #: Requests a drill lets through before injecting its fault, and after recovering.
    before: int = 3
    after: int = 2


class Run:
    """One stack, one history, the drills run on it in turn."""

    def __init__(self, root: Path, settings: Settings, tenants: list[str], nats_nodes: int = 1) -> None:
        self.root = root
        self.settings = settings
        self.stack = Stack(root, worker_specs(), tenants, nats_nodes=nats_nodes)
        self.reference = Reference()
        self.script = Script(self.reference, turns=settings.turns)
        self.history = History()
        self.observer = Observer(self.stack.nats.url, self.stack.subjects,
                                 self.stack.auth(nats_auth.Identity("observer")))
        self.faults: list[Fault] = []
        #: (drill, error) of drills that failed (the soak goes on after a failure and reports it).
        self.failures: list[tuple[str, str]] = []
        self.loads: list[Load] = []
        self.probes: list[asyncio.Future[list[float]]] = []
        self._runs: Counter[str] = Counter()
        self.started_s = 0.0
        self.report: checker.Report | None = None
        self.audit: dict[str, Any] | None = None
        #: forged transition's source id → (what is wrong with it, how the log holds it, reason)
        self.forged: dict[str, tuple[str, str, str]] = {}
        #: worker → its host tier against the ledger at the end (see :func:`host_drift`)
        self.host_drift: dict[str, dict[str, int]] = {}
        #: worker → granted writes its full GPU pool refused (a diverged view) and the room made for them
        self.pool_room: dict[str, dict[str, int]] = {}
        #: forged resume → (the reply's code, whether the refusal was logged)
        self.forged_resumes: dict[str, tuple[str, str]] = {}
        #: Where the log-archive drill writes the archive files; ``kvledger log verify``'s report of them.
        self.archive_dir = root / "log-archive"
        self.archives_verified: dict[str, Any] | None = None
        #: drill → wb's forwards split into lanes since its last start, read after the drill
        self.lane_forwards: dict[str, float] = {}

    async def _warm(self) -> None:
        """Every reference the drills need, computed while the stack starts."""
        await self.script.warm([c.cid for c in conversations(self.settings.conversations)] + POOL_CONVERSATIONS
                               + [GATEWAY_CONVERSATION.cid])
        for prompt, n in [*((p, 1) for p in churn_prompts()), *((p, 2) for p in spike_prompts(self.settings)),
                          *((probe_prompt(w), 2) for w in self.stack.specs)]:
            await self.reference.get(prompt, n)

    async def start(self) -> None:
        t0 = time.monotonic()
        warm = asyncio.get_running_loop().create_task(self._warm())
        try:
            await self.stack.start()
            await self.observer.start()
            await warm
        except BaseException:
            warm.cancel()
            raise
        self.started_s = time.monotonic() - t0

    async def stop(self) -> None:
        await self.abandon()
        await self.observer.stop()
        await self.stack.stop()
        await self.reference.stop()

    def load(self, drill: str, convs: list[Conversation] | None = None) -> Load:
        """The drill's load (``drill`` is also its tenant), not started."""
        load = Load(self.stack, self.script, self.history, drill, drill,
                    convs or [*conversations(self.settings.conversations), GATEWAY_CONVERSATION])
        self.loads.append(load)
        return load

    async def begin(self, drill: str) -> Load:
        """Start the drill's load and let ``settings.before`` requests through."""
        load = self.load(drill).start()
        await load.wait_done(self.settings.before)
        return load

    def probe(self, drill: str, since: float, *workers: str) -> asyncio.Future[list[float]]:
        """Start probing ``workers`` for reuse now (as the drill's tenant); the future gives each
        one's recovery seconds."""
        fut = asyncio.gather(*[probe_reuse(self.stack, self.script, self.history, drill, w, drill, since)
                               for w in workers])
        self.probes.append(fut)
        return fut

    async def abandon(self) -> None:
        """After a failed drill: cancel the load and probes it left running."""
        for fut in self.probes:
            fut.cancel()
        for load in self.loads:
            await load.cancel()
        await asyncio.gather(*self.probes, return_exceptions=True)
        make_writable(self.stack.offload_dir)

    async def churn_until(self, drill: str, tenant: str, measure: Any, above: float, rounds: int = 6) -> float:
        """Churn with fresh tenants (``tenant-0``, ``-1``, …) until ``await measure()`` exceeds ``above``."""
        value = await measure()
        for k in range(rounds):
            if value > above:
                break
            await self.churn(drill, f"{tenant}-{k}", "wa", "wb")
            value = await _until(measure, above=above, timeout_s=3)
        return value

    async def churn(self, drill: str, tenant: str, *workers: str) -> None:
        """Fresh blocks on each worker (CHURN prompts): older ones leave the small pools, to disk."""
        for wid in workers:
            for i, prompt in enumerate(churn_prompts()):
                want = await self.reference.get(prompt, 1)
                reply = await ask(self.stack, "debug", wid, prompt, 1, tenant)
                self.history.add(drill, -3, i, prompt, reply, want)

    async def warm_retained(self, drill: str) -> Retention:
        """Warm wr with fresh prompts (the drill's tenant), settle its outbox, and note what a
        resend reuses now."""
        k = self.count(Run.warm_retained)
        prompts = [rand_tokens(96, drill, "retained", k, i) for i in range(RETAINED_PROMPTS)]
        for _ in range(2):                        # the first fills the cache, the second reads it
            cached = await self._send_retained(drill, prompts)
            assert await self.stack.flush("wr"), "wr: transitions not settled before the fault"
        assert cached > 0, f"{drill}: wr reused nothing before the fault"
        return Retention(prompts, cached)

    async def retained_pct(self, drill: str, warm: Retention) -> float:
        """The first resend's cached tokens ÷ before, once wr and the ledger agree it is back."""
        await self.stack.wait_worker("wr")
        deadline = time.monotonic() + 60
        while True:
            w = next(w for w in (await self.stack.admin_get("/v1/workers"))["workers"] if w["worker_id"] == "wr")
            if w["alive"] and not w["suspended"] and (await self.stack.worker_readyz("wr"))[0] == 200:
                break
            assert time.monotonic() < deadline, f"{drill}: wr not back in contact within 60 s: {w}"
            await asyncio.sleep(0.1)
        return round(100 * await self._send_retained(drill, warm.prompts) / warm.cached, 1)

    async def _send_retained(self, drill: str, prompts: list[list[int]]) -> int:
        cached = 0
        for i, prompt in enumerate(prompts):
            want = await self.reference.get(prompt, 1)
            reply = await ask(self.stack, "debug", "wr", prompt, 1, drill)
            self.history.add(drill, -4, i, prompt, reply, want)
            assert reply.ok, f"{drill}: wr failed a retention request: {reply.error} {reply.detail}"
            cached += reply.cached_tokens
        return cached

    async def epochs(self) -> dict[str, int]:
        body = await self.stack.admin_get("/v1/workers")
        return {w["worker_id"]: w["epoch"] for w in body["workers"] if w["alive"]}

    def count(self, drill: Any) -> int:
        """How many times ``drill`` ran before (drills that alternate their fault use it)."""
        n = self._runs[drill.__name__]
        self._runs[drill.__name__] += 1
        return n

    def close(self, fault: Fault, allowed: set[str], load: Load, only_on: set[str] | None = None) -> Fault:
        """Fill in the drill's numbers and check its requests (errors in ``allowed``, on ``only_on``)."""
        recs = self.history.of(fault.drill)
        fault.requests = len(recs)
        fault.errors = dict(self.history.errors(fault.drill))
        fault.mismatches = len(self.history.mismatches(fault.drill))
        self.faults.append(fault)
        assert not fault.mismatches, (f"{fault.drill}: {fault.mismatches} answers differ from the cold run:\n"
                                      f"{self.history.describe_mismatches(fault.drill)}")
        assert not load.gave_up, f"{fault.drill}: turns never answered (conversation, turn): {load.gave_up}"
        unexplained = dict(Counter(r.error for r in recs if not r.ok and (
            r.error not in allowed or (only_on is not None and r.worker not in only_on))))
        assert not unexplained, (f"{fault.drill}: requests failed with errors this fault does not explain: "
                                 f"{unexplained}; e.g. "
                                 f"{[(r.worker, r.error, r.detail) for r in recs if r.error in unexplained][:3]}\n"
                                 f"{self.stack.log_tails()}")
        return fault


# --- the drills -----------------------------------------------------------------------------------

def kept_cache(f: Fault, before: dict[str, int], after: dict[str, int]) -> None:
    """A fault shorter than the resume grace period: no epoch changed, wr kept its cache."""
    f.evidence["epochs"] = {w: f"{before.get(w)}→{after.get(w)}" for w in sorted(after)}
    f.evidence["cache_retained_pct"] = f.retained_pct
    assert after == before, f"{f.drill}: epochs changed (the fleet lost its cache): {f.evidence['epochs']}"
    assert f.retained_pct is not None and f.retained_pct >= RETENTION_GOAL_PCT, \
        f"{f.drill}: cache_retained_pct {f.retained_pct} < {RETENTION_GOAL_PCT}"


async def coordinator_kill(run: Run, drill: str) -> Fault:
    """kill -9 the coordinator under load; restart it after a moment; it replays the log, and the
    workers resume their epochs with their caches."""
    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    f = Fault(drill, f"coordinator kill -9, restarted after {run.settings.coordinator_down_s}s", run.history.now())
    t0 = time.monotonic()
    run.stack.kill_coordinator()
    probe = run.probe(drill, t0, "wa", "wb")
    await asyncio.sleep(run.settings.coordinator_down_s)
    run.stack.start_coordinator()
    await run.stack.wait_coordinator()
    f.ready_s = time.monotonic() - t0
    await asyncio.gather(*[run.stack.wait_worker(w) for w in run.stack.specs])
    f.evidence["workers_ready_s"] = round(time.monotonic() - t0, 2)
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    f.retained_pct = await run.retained_pct(drill, warm)
    ready = await run.stack.admin_get("/readyz")
    f.evidence["replayed_events"] = (ready.get("last_replay") or {}).get("events")
    kept_cache(f, before, await run.epochs())
    return run.close(f, set(), load)


async def standby_takeover(run: Run, drill: str) -> Fault:
    """A hot standby follows the log; the leader is killed -9; the standby takes over from the
    log's tail, and the workers follow it and resume their epochs."""
    stack = run.stack
    stack.start_standby()
    deadline = time.monotonic() + 60
    while not isinstance((st := await stack.standby_status())[1], dict) or st[1].get("status") != "standby":
        assert time.monotonic() < deadline, f"the standby never reported standby: {st}\n{stack.log_tails()}"
        await asyncio.sleep(0.1)
    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    f = Fault(drill, "leader kill -9 while a second coordinator stands by", run.history.now())
    t0 = time.monotonic()
    stack.kill_coordinator()
    probe = run.probe(drill, t0, "wa", "wb")
    while (await stack.standby_status())[0] != 200:
        assert time.monotonic() - t0 < 60, f"the standby did not take over within 60 s\n{stack.log_tails()}"
        await asyncio.sleep(0.02)
    f.ready_s = time.monotonic() - t0
    stack.promote_standby()
    await asyncio.gather(*[stack.wait_worker(w) for w in stack.specs])
    f.evidence["workers_ready_s"] = round(time.monotonic() - t0, 2)
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    f.retained_pct = await run.retained_pct(drill, warm)
    replay = (await stack.admin_get("/readyz")).get("last_replay") or {}
    f.evidence["takeover_s"] = round(f.ready_s, 2)
    f.evidence["caught_up_events"] = replay.get("events")
    kept_cache(f, before, await run.epochs())
    return run.close(f, set(), load)


async def _coordinator_back(run: Run, f: Fault, t0: float, probe: asyncio.Future[list[float]], load: Load,
                            warm: Retention, before: dict[str, int]) -> Fault:
    """The end of a drill that held the coordinator back: ready again, reuse again, cache kept."""
    await run.stack.wait_coordinator()
    f.ready_s = time.monotonic() - t0
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    f.retained_pct = await run.retained_pct(f.drill, warm)
    kept_cache(f, before, await run.epochs())
    return run.close(f, set(), load)


async def coordinator_stall(run: Run, drill: str) -> Fault:
    """SIGSTOP the coordinator for a few seconds (a GC pause, a stuck host), then SIGCONT."""
    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    f = Fault(drill, f"coordinator SIGSTOP {run.settings.stall_s}s, then SIGCONT", run.history.now())
    t0 = time.monotonic()
    run.stack.signal_coordinator(signal.SIGSTOP)
    probe = run.probe(drill, t0, "wa", "wb")
    try:
        await asyncio.sleep(run.settings.stall_s)
    finally:
        run.stack.signal_coordinator(signal.SIGCONT)
    return await _coordinator_back(run, f, t0, probe, load, warm, before)


async def cpu_starvation(run: Run, drill: str) -> Fault:
    """The coordinator gets a fifth of a CPU for a while (SIGSTOP/SIGCONT duty cycle): heartbeats
    and leases wait, ingest backs up; nobody may be declared lost for it."""
    st = run.settings
    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    f = Fault(drill, f"coordinator runs {st.starve_run_ms} ms of every {st.starve_period_ms} ms for {st.starve_s}s",
              run.history.now())
    t0 = time.monotonic()
    probe = run.probe(drill, t0, "wa", "wb")
    try:
        while time.monotonic() - t0 < st.starve_s:
            run.stack.signal_coordinator(signal.SIGSTOP)
            await asyncio.sleep((st.starve_period_ms - st.starve_run_ms) / 1000)
            run.stack.signal_coordinator(signal.SIGCONT)
            await asyncio.sleep(st.starve_run_ms / 1000)
    finally:
        run.stack.signal_coordinator(signal.SIGCONT)
    return await _coordinator_back(run, f, t0, probe, load, warm, before)


async def coordinator_stall_past_grace(run: Run, drill: str) -> Fault:
    """SIGSTOP the coordinator for longer than the resume grace period: the workers give their
    epochs up and register anew — the fence, by design (0 % retained)."""
    stall = RESUME_GRACE_MS / 1000 + 3
    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    f = Fault(drill, f"coordinator SIGSTOP {stall:.0f}s (resume grace {RESUME_GRACE_MS / 1000:.0f}s), then SIGCONT",
              run.history.now())
    t0 = time.monotonic()
    run.stack.signal_coordinator(signal.SIGSTOP)
    probe = run.probe(drill, t0, "wa", "wb")
    try:
        await asyncio.sleep(stall)
    finally:
        run.stack.signal_coordinator(signal.SIGCONT)
    await run.stack.wait_coordinator()
    await asyncio.gather(*[run.stack.wait_worker(w, epoch_above=before[w]) for w in run.stack.specs])
    f.ready_s = time.monotonic() - t0
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    f.retained_pct = await run.retained_pct(drill, warm)
    after = await run.epochs()
    f.evidence = {"epochs": {w: f"{before.get(w)}→{after.get(w)}" for w in sorted(after)},
                  "cache_retained_pct": f.retained_pct}
    assert all(after[w] > before[w] for w in run.stack.specs), f"{drill}: an epoch outlived the grace: {after}"
    assert f.retained_pct == 0, f"{drill}: a fenced epoch's cache was reused ({f.retained_pct} %)"
    return run.close(f, set(), load)


async def worker_kill(run: Run, drill: str) -> Fault:
    """kill -9 a worker with requests in flight (wb, then wa, in turn), while it writes blocks to
    the shared offload directory; restart it; its old epoch is fenced, and the other worker keeps
    reading the victim's segments (a record cut short by the kill is lost alone)."""
    victim = ("wb", "wa")[run.count(worker_kill) % 2]
    load = await run.begin(drill)
    old = (await run.epochs())[victim]
    f = Fault(drill, f"worker {victim} kill -9 under load (spilling to the shared disk tier), restarted at once",
              run.history.now())
    segs0 = len(list((run.stack.offload_dir / "segments" / victim).glob("*.kvs")))
    churn = asyncio.get_running_loop().create_task(run.churn(drill, f"{drill}-push0", victim))
    await asyncio.sleep(0.5)                      # fresh blocks push older ones out: spills under way
    t0 = time.monotonic()
    run.stack.kill_worker(victim)
    await churn
    run.stack.start_worker(victim)
    probe = run.probe(drill, t0, victim)
    await run.stack.wait_worker(victim, epoch_above=old)
    f.ready_s = time.monotonic() - t0
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    new = (await run.epochs())[victim]
    assert new > old, f"{victim} came back with epoch {new}, not above {old}"
    # the same fault on the retention witness: a process that lost its memory starts cold
    warm = await run.warm_retained(drill)
    wr_old = (await run.epochs())["wr"]
    run.stack.kill_worker("wr")
    run.stack.start_worker("wr")
    await run.stack.wait_worker("wr", epoch_above=wr_old)
    f.retained_pct = await run.retained_pct(drill, warm)
    f.evidence = {f"{victim}_epoch": f"{old}→{new}", "wr_epoch": f"{wr_old}→{(await run.epochs())['wr']}",
                  "cache_retained_pct (wr killed too)": f.retained_pct,
                  f"{victim}_segments_before_kill": segs0,
                  f"{victim}_torn_tail_bytes": torn_tail_bytes(run.stack.offload_dir, victim)}
    assert f.retained_pct == 0, f"{drill}: a killed worker's fenced cache was reused ({f.retained_pct} %)"
    return run.close(f, KILLED_WORKER, load, only_on={victim})


async def nats_kill(run: Run, drill: str) -> Fault:
    """kill -9 nats-server (JetStream loses what it had not synced); restart it on the same port."""
    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    f = Fault(drill, f"nats-server kill -9, restarted after {run.settings.nats_down_s}s", run.history.now())
    t0 = time.monotonic()
    await run.stack.kill_nats()
    probe = run.probe(drill, t0, "wa", "wb")
    await asyncio.sleep(run.settings.nats_down_s)
    await run.stack.start_nats()
    for w in run.stack.specs:
        await run.stack.wait_worker(w)
    f.ready_s = time.monotonic() - t0
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    f.retained_pct = await run.retained_pct(drill, warm)
    f.evidence["observer_disconnects"] = run.observer.disconnects
    kept_cache(f, before, await run.epochs())
    return run.close(f, NATS_DOWN, load)


async def postgres_outage(run: Run, drill: str) -> Fault:
    """PostgreSQL down a while (requests must still be answered), then started again: killed -9
    (crash recovery) the first time, a clean fast shutdown the next, in turn."""
    crash = run.count(postgres_outage) % 2 == 0
    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    how = "kill -9 (crash recovery on start)" if crash else "fast shutdown"
    f = Fault(drill, f"PostgreSQL {how}, down {run.settings.postgres_down_s}s, started again", run.history.now())
    t0, down_at = time.monotonic(), run.history.now()
    await (run.stack.kill_postgres() if crash else run.stack.stop_postgres())
    probe = run.probe(drill, t0, "wa", "wb")
    statuses: Counter[str] = Counter()

    def answered() -> int:
        return sum(1 for r in run.history.of(drill) if r.ok and r.at + r.seconds >= down_at)

    # down for postgres_down_s, and (bounded) until requests were answered and readyz said so
    while time.monotonic() - t0 < 30 and (time.monotonic() - t0 < run.settings.postgres_down_s
                                          or not answered() or not statuses["not serving"]):
        statuses["serving" if await run.stack.coordinator_ready() else "not serving"] += 1
        await asyncio.sleep(0.25)
    served_while_down = answered()
    await run.stack.start_postgres()
    await run.stack.wait_coordinator()
    f.ready_s = time.monotonic() - t0
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    f.retained_pct = await run.retained_pct(drill, warm)
    f.evidence = {"answered_while_down": served_while_down, "coordinator_readyz_while_down": dict(statuses)}
    assert served_while_down > 0, "no request was answered while PostgreSQL was down (workers must recompute)"
    assert statuses["not serving"] > 0, "the coordinator said it was serving with PostgreSQL down"
    kept_cache(f, before, await run.epochs())
    return run.close(f, set(), load)


async def offload_readonly(run: Run, drill: str) -> Fault:
    """The shared offload directory made read-only (writes fail), then removed altogether."""
    stack = run.stack
    load = await run.begin(drill)
    root = stack.offload_dir
    root.mkdir(exist_ok=True)
    failures = "kvl_worker_offload_failures_total"
    fails0 = await _sum_metric(stack, failures, tier="disk")
    f = Fault(drill, "offload dir read-only (writes fail), then removed", run.history.now())
    t0 = time.monotonic()
    f.evidence["read_only"] = make_read_only(root)
    probe = run.probe(drill, t0, "wa", "wb")
    try:
        # fresh blocks (fresh tenants: nothing cached) until a worker has tried to write to disk
        fails = await run.churn_until(drill, f"{drill}-ro", lambda: _sum_metric(stack, failures, tier="disk"),
                                      fails0)
    finally:
        make_writable(root)
    f.evidence["disk_write_failures"] = int(fails - fails0)
    shutil.rmtree(root, ignore_errors=True)
    # NOTE: counted from here, not from before the removal: a spill written while rmtree ran lands
    # in a file that is gone, and would pass for a resumed write with no file to show for it
    written0 = await _sum_metric(stack, "kvl_worker_offload_bytes_total", tier="disk")
    await load.wait_done(run.settings.before)
    # after its back-off the tier is tried again and the writer recreates the directory

    async def files() -> int:
        return len(segment_files(root))
    await asyncio.sleep(OFFLOAD_RETRY_S)
    await run.churn_until(drill, f"{drill}-rm", files, 0)
    written = await _sum_metric(stack, "kvl_worker_offload_bytes_total", tier="disk")
    f.recovery_s = max(await probe)
    await load.stop()
    f.evidence["files_after_removal"] = len(segment_files(root))
    f.evidence["writes_resumed"] = written > written0
    assert f.evidence["disk_write_failures"] > 0, f"no disk write failed while the directory was read-only: {f.evidence}"
    assert f.evidence["writes_resumed"] and f.evidence["files_after_removal"], f"disk writes never resumed: {f.evidence}"
    return run.close(f, set(), load)


async def offload_damage(run: Run, drill: str) -> Fault:
    """Offload files corrupted (a flipped byte) and truncated; a reload must reject them and refill."""
    stack = run.stack
    load = await run.begin(drill)
    # the churn prompts on both workers, then other tenants' fresh blocks push them out to disk
    await run.churn(drill, drill, "wa", "wb")
    for k in range(2):
        await run.churn(drill, f"{drill}-push{k}", "wa", "wb")
    for w in ("wa", "wb"):
        assert await stack.flush(w), f"{w}: spills and transitions not settled"
    recs = records(stack.offload_dir)
    in_ledger = {(r["block_hash"], r["form"]) for r in await stack.replicas(location="disk", state="READY")}

    def key(r: Record) -> tuple[str, str]:
        return r.header.block_hash, r.header.form

    f = Fault(drill, f"{len(recs)} segment records damaged (flipped payload or header byte; each segment cut "
                     f"inside its last record)", run.history.now())
    t0 = time.monotonic()
    kinds: Counter[str] = Counter()
    last: dict[Path, Record] = {}
    for i, r in enumerate(recs):
        last[r.path] = r
        if i % 3 == 2:
            continue                             # a third left whole
        with contextlib.suppress(FileNotFoundError):
            (flip_payload if i % 3 == 0 else flip_header)(r)
            kinds["payload" if i % 3 == 0 else "header"] += 1
    for r in last.values():
        with contextlib.suppress(FileNotFoundError):
            cut_inside(r)
            kinds["truncated"] += 1
    probe = run.probe(drill, t0, "wa", "wb")
    attempts0 = await _sum_metric(stack, "kvl_worker_reload_seconds_count", tier="disk")
    rejected0 = await _sum_metric(stack, "kvl_worker_reload_failures_total", tier="disk")
    # ask the churn prompts again: what a worker reuses of them now comes (partly) from disk
    await run.churn(drill, drill, "wa", "wb")
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    attempts = await _sum_metric(stack, "kvl_worker_reload_seconds_count", tier="disk") - attempts0
    rejected = await _sum_metric(stack, "kvl_worker_reload_failures_total", tier="disk") - rejected0
    invalid = [r for r in run.history.of(drill) if any(x.startswith("integrity") for x in r.invalid)]
    f.evidence = {"damaged": dict(kinds), "damaged_and_ready_in_ledger": sum(key(r) in in_ledger for r in recs),
                  "disk_reloads": int(attempts), "reloads_rejected": int(rejected),
                  "requests_with_integrity_failures": len(invalid)}
    if not rejected:
        f.not_exercised = ("no request reloaded a damaged file (no READY disk replica of a damaged file was "
                           "offered: see the evidence)")
    return run.close(f, set(), load)


async def offload_full(run: Run, drill: str) -> Fault:
    """The offload directory's file system filled up (ENOSPC on every write), then freed."""
    stack = run.stack
    load = await run.begin(drill)
    f = Fault(drill, "offload file system full (ENOSPC), then freed", run.history.now())
    if not stack.offload_fs:
        await load.stop()
        f.not_exercised = f"no small file system for the offload directory: {stack.offload_fs_reason}"
        return run.close(f, set(), load)
    failures = "kvl_worker_offload_failures_total"
    fails0 = await _sum_metric(stack, failures, tier="disk", reason="unavailable")
    t0 = time.monotonic()
    filler, size = await asyncio.to_thread(fill_fs, stack.offload_dir, OFFLOAD_FS_BYTES)
    f.evidence["filler_mib"] = round(size / 2**20, 1)
    probe = run.probe(drill, t0, "wa", "wb")
    try:
        fails = await run.churn_until(drill, f"{drill}-full", lambda: _sum_metric(stack, failures, tier="disk",
                                                                                  reason="unavailable"), fails0)
    finally:
        filler.unlink()
    f.evidence["disk_write_failures"] = int(fails - fails0)
    f.evidence["enospc_logged"] = any("ENOSPC" in stack.workers[w].log.read_text(errors="replace")
                                      for w in ("wa", "wb"))
    written0 = await _sum_metric(stack, "kvl_worker_offload_bytes_total", tier="disk")
    await load.wait_done(run.settings.before)
    await asyncio.sleep(OFFLOAD_RETRY_S)           # the tier's back-off, then writes resume
    written = await run.churn_until(drill, f"{drill}-freed",
                                    lambda: _sum_metric(stack, "kvl_worker_offload_bytes_total", tier="disk"), written0)
    f.recovery_s = max(await probe)
    await load.stop()
    f.evidence["writes_resumed"] = written > written0
    f.evidence["disk_gc_deleted"] = int(await _sum_metric(stack, "kvl_worker_disk_gc_segments_total", outcome="deleted"))
    f.evidence["disk_gc_kept_pinned"] = int(await _sum_metric(stack, "kvl_worker_disk_gc_segments_total", outcome="pinned"))
    assert f.evidence["disk_write_failures"] > 0, f"no disk write failed while the file system was full: {f.evidence}"
    assert f.evidence["enospc_logged"], "the workers did not say ENOSPC"
    assert f.evidence["writes_resumed"], f"disk writes never resumed once space was freed: {f.evidence}"
    return run.close(f, set(), load)


async def pool_exhausted(run: Run, drill: str) -> Fault:
    """Worker wp's smallest pool (``tail``, or a one-form model's only pool: 2 slots) under three
    concurrent conversations: capacity refused."""
    stack = run.stack
    convs = [Conversation(cid, "http" if cid % 2 else "debug", ("wp",)) for cid in POOL_CONVERSATIONS]
    refused0 = await stack.metric("wp", "kvl_worker_lease_errors_total", code="over_capacity")
    fb0 = await stack.metric("wp", "kvl_worker_fallbacks_total")
    f = Fault(drill, f"wp's smallest pool (2 slots) exhausted by {len(convs)} concurrent conversations",
              run.history.now())
    t0 = time.monotonic()
    peak: dict[str, int] = {}                 # the most slots of each wp pool seen in use during the load

    async def watch() -> None:
        # NOTE: sampled all along: at any one instant (say, the load's end) a request may just have
        # released its slots, so "full at the end" would be a coin toss, not evidence
        while True:
            with contextlib.suppress(Exception):
                pools = await stack.admin_get("/v1/pools", timeout_s=5)
                for form, p in next(p for p in pools["pools"] if p["worker_id"] == "wp")["forms"].items():
                    peak[form] = max(peak.get(form, 0), p["used"])
            await asyncio.sleep(0.05)

    watcher = asyncio.get_running_loop().create_task(watch())
    load = run.load(drill, convs).start()
    try:
        await load.wait_done(len(convs) * run.script.turns)
        pools = await stack.admin_get("/v1/pools")
        await load.stop()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    # reuse comes back once the pressure is gone (from the start of the pressure)
    f.recovery_s = max(await run.probe(drill, t0, "wp"))
    wp = next(p for p in pools["pools"] if p["worker_id"] == "wp")
    refused = await stack.metric("wp", "kvl_worker_lease_errors_total", code="over_capacity") - refused0
    fallbacks = await stack.metric("wp", "kvl_worker_fallbacks_total") - fb0
    form = pressured_form(wp["forms"])
    pool = wp["forms"][form]
    f.evidence = {f"{form}_pool": pool, f"{form}_peak_used": peak.get(form, 0),
                  "over_capacity_refusals": int(refused), "fallbacks": int(fallbacks),
                  "reused_requests": sum(1 for r in run.history.of(drill) if r.cached_tokens > 0)}
    assert pool["limit"] <= 2 and peak.get(form, 0) == pool["limit"], f"wp's {form} pool never filled: {f.evidence}"
    assert refused + fallbacks > 0, f"wp never ran out of {form} slots: {f.evidence}"
    return run.close(f, set(), load)


async def spike(run: Run, drill: str) -> Fault:
    """5× service.max_concurrency requests at once on wa (2 running + 4 queued): the rest get a 429.
    They share a stem nobody has cached, so the requests running together also take the path
    where one waits for the other's commit of it (``worker.inflight``: ``prefix_waits``)."""
    stack = run.stack
    load = await run.begin(drill)
    limit = MAX_CONCURRENCY
    prompts = spike_prompts(run.settings)
    n = len(prompts)
    wants = await asyncio.gather(*[run.reference.get(p, 2) for p in prompts])
    f = Fault(drill, f"{n} simultaneous requests on wa (max_concurrency {limit}, queue {QUEUE_SIZE})",
              run.history.now())
    waits0 = {o: await stack.metric("wa", "kvl_worker_prefix_waits_total", outcome=o)
              for o in ("committed", "abandoned", "timeout")}
    t0 = time.monotonic()
    burst = asyncio.gather(*[stack.http_generate("wa", p, 2, drill) for p in prompts])
    probe = run.probe(drill, t0, "wa")
    replies = await burst
    for i, (p, r, w) in enumerate(zip(prompts, replies, wants)):
        run.history.add(drill, -2, i, p, r, w)
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    outcome = Counter(r.error or "ok" for r in replies)
    f.evidence = {"spike": dict(outcome), "spike_seconds": round(max(r.seconds for r in replies), 2),
                  "reused": sum(1 for r in replies if r.cached_tokens > 0),
                  "prefix_waits": {o: round(await stack.metric("wa", "kvl_worker_prefix_waits_total", outcome=o) - n)
                                   for o, n in waits0.items()}}
    assert outcome["ok"] >= limit, f"fewer than max_concurrency spike requests succeeded: {dict(outcome)}"
    assert outcome["http 429 queue_full"] > 0, f"no spike request was refused with 429: {dict(outcome)}"
    return run.close(f, QUEUE, load)


async def log_archive(run: Run, drill: str) -> Fault:
    """Archive the log's oldest events under load, as an operator would (``kvledger log archive``:
    a fresh snapshot is the anchor; the events up to it go to a file, proven to fold to it, then
    leave the database). The fleet keeps serving and keeps its cache; every later drill runs on
    the archived log; the history check reads the archive files back, the audit starts at the
    anchor, and ``kvledger log verify`` re-folds the files (:func:`final_check`)."""
    import asyncpg

    from coordinator.core import CoreParams
    from coordinator.log.archive import archive

    warm = await run.warm_retained(drill)
    load = await run.begin(drill)
    before = await run.epochs()
    f = Fault(drill, "log archived up to a fresh snapshot under load", run.history.now())
    t0 = time.monotonic()
    snap = await run.stack.admin_post("/v1/snapshot")
    probe = run.probe(drill, t0, "wa", "wb")
    conn = await asyncpg.connect(run.stack.pg.url, server_settings={"statement_timeout": "0"})
    try:
        out = await archive(conn, run.archive_dir, snap["position"], CoreParams())
    finally:
        await conn.close()
    f.ready_s = time.monotonic() - t0
    summary = await run.stack.admin_get("/v1/summary")
    assert summary["archived_upto"] == out["last_position"], summary
    f.recovery_s = max(await probe)
    await load.wait_done(run.settings.after)
    await load.stop()
    f.retained_pct = await run.retained_pct(drill, warm)
    f.evidence.update(archived_events=out["events"], archive_file_bytes=out["bytes"],
                      archive_s=round(f.ready_s, 2))
    kept_cache(f, before, await run.epochs())
    return run.close(f, set(), load)


async def fused_mismatch(run: Run, drill: str) -> Fault:
    """wa restarted with fused forwards that depend on the batch (failpoint ``fused_skew``: what a
    kernel the start-up probe missed would do) and a run-time check on every fused forward, under
    load: the checked step fails (503, retried; the gateway tries another worker), wa stops fusing
    and registers a new epoch that disowns what it computed, its copies on the shared disk too
    (made by the ordinary process before: disowned all the same). Then restarted without the
    failpoint. Every answer equals the cold run; no disk copy wa made is READY after the disown."""
    stack, victim = run.stack, "wa"

    async def owned_on_disk() -> set[tuple[str, str]]:
        return {(r["block_hash"], r["form"]) for r in await stack.replicas(location="disk", state="READY")
                if r["owner"] == victim}

    async def on_disk() -> int:
        await stack.debug(victim, "flush", {"timeout_s": 10}, timeout_s=20)
        return len(await owned_on_disk())
    await run.churn_until(drill, f"{drill}-full", on_disk, 0)   # fresh blocks push older ones to disk
    before = await owned_on_disk()
    assert before, f"{drill}: {victim} holds no disk copies to disown (the churn pushed nothing out)"
    # other workers' reloads of those copies (the same bytes): the disown takes them too
    content = {(r["block_hash"], r["form"], r["checksum"]) for r in await stack.replicas(location="disk", state="READY")
               if r["owner"] == victim}
    elsewhere = sum((r["block_hash"], r["form"], r["checksum"]) in content and not r["location"].endswith(f":{victim}")
                    for r in await stack.replicas(state="READY") if r["location"] != "disk")
    old = (await run.epochs())[victim]
    f = Fault(drill, f"worker {victim} restarted with batch-dependent fused forwards (failpoint fused_skew), "
              "checked on every fused forward", run.history.now())
    stack.kill_worker(victim)
    stack.start_worker(victim, failpoints="fused_skew", service={"fused_check_every": 1})
    try:
        skewed = (await stack.wait_worker(victim, epoch_above=old))["epoch"]
        await stack.wait_gateway()
        t0 = time.monotonic()
        load = await run.begin(drill)
        # two churns at once on wa besides the load: fused forwards for certain
        await asyncio.gather(*(run.churn(drill, f"{drill}-push{k}", victim) for k in range(2)))
        differs = await _until(lambda: stack.metric(victim, "kvl_worker_fused_checks_total", outcome="differs"),
                               above=0, timeout_s=60)
        after = (await stack.wait_worker(victim, epoch_above=skewed))["epoch"]
        f.ready_s = time.monotonic() - t0
        disowned = await stack.metric(victim, "kvl_worker_disowned_replicas_total")
        await load.wait_done(run.settings.after)
        await load.stop()
        left = before & await owned_on_disk()
    finally:
        if stack.workers[victim].alive:
            stack.kill_worker(victim)
        stack.start_worker(victim)
        await stack.wait_worker(victim)
        await stack.wait_gateway()
    f.recovery_s = time.monotonic() - t0
    f.evidence = {f"{victim}_epoch": f"{old}→{skewed}→{after}→{(await run.epochs())[victim]}",
                  "fused_checks_differ": int(differs), "disk_copies_before": len(before),
                  "copies_elsewhere_before": elsewhere, "disowned": int(disowned),
                  "disk_copies_still_ready": len(left)}
    assert differs >= 1, f"{drill}: no fused forward was checked and found to differ: {f.evidence}"
    assert after > skewed and disowned >= len(before), f"{drill}: no disown: {f.evidence}"
    assert not left, f"{drill}: disk copies {victim} made are READY after its disown: {sorted(left)[:3]}"
    return run.close(f, {"http 503 unavailable", "worker error"}, load, only_on={victim})


async def _sum_metric(stack: Stack, name: str, **labels: str) -> float:
    vals = await asyncio.gather(*[stack.metric(w, name, **labels) for w in stack.specs])
    return float(sum(vals))


async def _until(probe: Any, *, above: float, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    v = await probe()
    while v <= above and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        v = await probe()
    return v


ALL = {"coordinator-kill": coordinator_kill, "standby-takeover": standby_takeover,
       "coordinator-stall": coordinator_stall, "cpu-starvation": cpu_starvation, "worker-kill": worker_kill,
       "nats-kill": nats_kill, "postgres-outage": postgres_outage,
       "coordinator-stall-past-grace": coordinator_stall_past_grace, "offload-readonly": offload_readonly,
       "offload-damage": offload_damage, "offload-full": offload_full, "pool-exhausted": pool_exhausted,
       "spike": spike, "log-archive": log_archive, "fused-mismatch": fused_mismatch}


# --- the end of a run -----------------------------------------------------------------------------

async def forge_illegal(run: Run) -> dict[str, str]:
    """Publish transitions the ledger must refuse, as a confused or stale worker would; returns
    ``{source id: what is wrong with it}``.

    NOTE: the forged seqs of live epochs are far above anything the workers reach, so they
    never collide with a real transition's source id.
    """
    stack = run.stack
    workers = {w["worker_id"]: w for w in (await stack.admin_get("/v1/workers"))["workers"]}
    ns = workers["wa"]["namespace"]
    wa, wb = workers["wa"]["epoch"], workers["wb"]["epoch"]
    block = "f" * 32
    R = ReplicaState
    # wa's first epoch is fenced once wa has re-registered (any drill that restarts something)
    stale = ((1, "wa's first epoch, fenced since") if wa > 1 else (wa + 100, "an epoch wa never registered"))
    forged = {
        ("ghost", 1, 1, "gpu:ghost", R.ALLOCATED, R.READY): "a worker that never registered",
        ("wa", stale[0], 10**6, "gpu:wa", R.READY, R.EVICTED): stale[1],
        ("wa", wa, 10**9, "gpu:wa", None, R.ALLOCATED): "a move only the coordinator makes (a grant)",
        ("wb", wb, 10**9, "gpu:wa", R.ALLOCATED, R.READY): "wb committing a replica on wa's GPU",
    }
    out = {}
    for (wid, epoch, seq, loc, frm, to), why in forged.items():
        # each sent as the worker it names (NATS lets nobody else publish there): a stale, confused
        # or compromised worker, and "ghost", an identity that never registered
        js = (await stack.client(nats_auth.worker(wid))).jetstream()
        t = m.TransitionEvent(worker_id=wid, epoch=epoch, seq=seq, namespace=ns, block_hash=block,
                              parent_hash="0" * 32, token_start=0, token_end=16, form="swa", location=loc,
                              from_state=frm, to_state=to, generation=1, checksum="c" * 32, ts_ms=m.now_ms())
        await js.publish(stack.subjects.events(wid), m.encode(t), headers={"Nats-Msg-Id": t.source_id})
        out[t.source_id] = why
    return out


async def pool_room(run: Run, wid: str) -> dict[str, int]:
    """Granted writes ``wid``'s full GPU pools refused (its view and the ledger's diverged) and the
    coordinator's answers to its requests for room, from its metrics (0 for a worker that is down)."""
    out = {"refused_writes": 0, "evicted": 0, "pinned": 0, "deferred": 0}
    with contextlib.suppress(Exception):
        out["refused_writes"] = int(await run.stack.metric(wid, "kvl_worker_pool_divergences_total"))
        for outcome in ("evicted", "pinned", "deferred"):
            out[outcome] = int(await run.stack.metric(wid, "kvl_worker_pool_room_evictions_total", outcome=outcome))
    return out


async def host_drift(run: Run, wid: str) -> dict[str, int]:
    """The worker's host tier against the ledger's READY ``host:<worker>`` replicas.

    The audit compares host tiers too (the inventory lists them); this is the drills' own count
    of the same, reported beside it, from the inventory and the admin API rather than the audit.
    """
    stack = run.stack
    # as the coordinator asks it (only the coordinator may)
    nc = await stack.client(nats_auth.Identity("coordinator"))
    msg = await nc.request(stack.subjects.inventory(wid), m.encode(m.InventoryRequest(request_id="drills")),
                                 timeout=10)
    reply = m.decode(msg.data, expect=m.InventoryReply)
    has = {(i.block_hash, i.form) for i in reply.items if i.location == f"host:{wid}"}
    ledger = {(r["block_hash"], r["form"]) for r in await stack.replicas(location=f"host:{wid}", state="READY")}
    return {"ledger": len(ledger), "worker": len(has), "ledger_only": len(ledger - has),
            "worker_only": len(has - ledger)}


async def forge_resumes(run: Run) -> dict[str, tuple[str, str]]:
    """Resumes the coordinator must refuse, as a stale or confused worker would send them;
    returns ``{what is wrong: (the reply's code, whether the coordinator logged the refusal)}``.

    NOTE: the refusal comes before any inventory is looked at, so the forged inventory and
    catalogue need only be well formed.
    """
    stack = run.stack
    workers = {w["worker_id"]: w for w in (await stack.admin_get("/v1/workers"))["workers"]}
    wa = workers["wa"]
    stale = ("wa", 1, "wa's first epoch, fenced since") if wa["epoch"] > 1 else \
        ("wa", wa["epoch"] + 100, "an epoch wa never registered")
    catalogue = FormCatalogue(model_id="forged", block_size=16, forms=(
        FormSpec(name="swa", scope=FormScope.WINDOW, bytes_per_block=32, dtype="float32", window_tokens=16),))
    out = {}
    for wid, epoch, why in (stale, ("ghost", 1, "a worker that never registered")):
        res = m.WorkerResume(worker_id=wid, epoch=epoch, namespace=wa["namespace"], catalogue=catalogue,
                             held=bytes(8))
        nc = await stack.client(nats_auth.worker(wid))     # as that worker: nobody else may send it
        reply = m.decode((await nc.request(stack.subjects.request("resume", wid), m.encode(res), timeout=10)).data)
        out[why] = (reply.code.value if isinstance(reply, m.ErrorReply) else type(reply).__name__, wid, epoch)
    await asyncio.sleep(0.5)
    log = stack.coordinator.tail(20_000) if stack.coordinator is not None else ""
    refused = [line for line in log.splitlines() if "resume_refused" in line]
    return {why: (code, "logged" if any(f'"worker_id": "{wid}"' in line and f'"epoch": {epoch}' in line
                                        for line in refused) else "not logged")
            for why, (code, wid, epoch) in out.items()}


def archived_events(run: Run) -> list[dict[str, Any]]:
    """The events the log-archive drill moved into files, as ``GET /v1/events`` shows events, after
    ``kvledger log verify``'s check of the files (kept in ``run.archives_verified``)."""
    import json

    from coordinator.core import CoreParams
    from coordinator.log.archive import read_archive, verify_archives

    files = sorted(run.archive_dir.glob("kvledger-log-*.jsonl.gz"))
    if not files:
        return []
    run.archives_verified = verify_archives(files, CoreParams())
    out = []
    for path in files:
        _, rows = read_archive(path)
        out += [{"position": r[0], "stream_id": r[1], "stream_version": r[2], "source_id": r[3], "type": r[4],
                 "leader_epoch": r[5], "recorded_at": r[6], "event": json.loads(r[7])} for r in rows]
    return out


def drill_kind(name: str) -> str:
    """The drill a fault's name comes from: the soak names each run ``<drill>-<cycle>``."""
    return max((d for d in DRILLS if name == d or name.startswith(d + "-")), key=len, default=name)


def audit_findings(run: Run, audit: dict[str, Any]) -> dict[str, Any]:
    """What the audit found that the run does not explain (empty = clean but for the known).

    The audit compares every tier, GPU and host alike (the host tier no longer drops what a
    lease pins: ``test_host_tier_pins.py``). Explained: on the disk tier, records the drills
    damaged or removed on purpose (offload-damage, offload-readonly), and only when those drills
    ran.
    """
    out: dict[str, Any] = {}
    for key in ("hash_match",):
        if not audit.get(key):
            out[key] = audit.get(key)
    for key in ("log_errors", "invariant_violations", "replay_invariant_violations", "workers_unreachable"):
        if audit.get(key):
            out[key] = audit[key]
    for wid, d in (audit.get("drift") or {}).items():
        tiers = d.get("tiers") or {}
        odd = {loc: t for loc, t in tiers.items() if t.get("ledger_only") or t.get("worker_only")}
        if odd or not tiers:
            out[f"drift {wid}"] = d
    disk = audit.get("disk") or {}
    damaged = (disk.get("missing") or {}).get("count", 0) + (disk.get("damaged") or {}).get("count", 0)
    injected = {drill_kind(f.drill) for f in run.faults} & {"offload-damage", "offload-readonly"}
    if damaged and not injected:
        out["disk"] = disk
    return out


async def note_lane_forwards(run: Run, drill: str) -> None:
    """Record wb's split forwards after a drill (nothing when wb is not answering)."""
    try:
        run.lane_forwards[drill] = await run.stack.metric("wb", "kvl_worker_lane_forwards_total")
    except (OSError, asyncio.TimeoutError, aiohttp.ClientError):
        pass


async def final_check(run: Run) -> tuple[checker.Report, dict[str, Any]]:
    """Heal, settle every outbox, forge illegal transitions, then check the whole history and
    audit the ledger."""
    stack = run.stack
    await stack.heal()
    for w in stack.specs:
        assert await stack.flush(w, 30), f"{w}: outbox not drained by the commit watermark within 30s"
    forged = await forge_illegal(run)
    run.forged_resumes = await forge_resumes(run)
    archived = archived_events(run)
    deadline = time.monotonic() + 30
    while True:
        log = archived + await stack.events()
        logged = {r["source_id"]: r for r in log if r["type"].startswith("transition.")}
        # the refusals a coalesced rejection row stands for (coordinator.core.rejections)
        logged.update({f"{t['worker_id']}.{t['epoch']}.{seq}": r for r in log if r["type"] == "transition.rejected"
                       for t in [r["event"]["transition"]] for lo, hi in r["event"].get("more", [])
                       for seq in range(lo, hi + 1)})
        if all(sid in logged for sid in forged) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    await run.observer.settle()
    run.report = checker.check(log, run.observer.seen)
    run.forged = {sid: (why, logged[sid]["type"] if sid in logged else "absent",
                        logged.get(sid, {}).get("event", {}).get("reason", "")) for sid, why in forged.items()}
    run.host_drift = {w: await host_drift(run, w) for w in stack.specs
                      if stack.worker_config(w)["cache"].get("host_tier_bytes")}
    run.pool_room = {w: await pool_room(run, w) for w in stack.specs}
    run.audit = await stack.admin_post("/v1/audit", {"replay_from": "empty", "check_workers": True,
                                                     "timeout_ms": 10_000})
    return run.report, run.audit
