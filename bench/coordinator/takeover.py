"""Phase of ``bench.coordinator``: a hot standby on the same log takes over from a killed leader
while a worker churns leases; the worker resumes its epoch with what it holds."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path
from typing import Any

from bench.coordinator.harness import CACHED_BLOCKS, PROMPT_BLOCKS, CoordinatorProc, h, log
from bench.coordinator.synthetic_worker import BenchWorker, commit_blocks


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
            log(f"takeover {rnd}/{rounds}: starting a standby coordinator on the same database and prefix "
                 f"(log at {position:,}) ...")
            standby.start()
            follow_s, _ = await standby.wait_standby(position)
            log(f"takeover {rnd}/{rounds}: standby following the log after {follow_s:.2f} s; {TAKEOVER_LOAD_S:g} s "
                 "of leases (one at a time) on the leader, then SIGKILL ...")
            stop = asyncio.Event()
            grants: list[tuple[float, float]] = []
            load = asyncio.create_task(churn(w, cached, stop, grants))
            await asyncio.sleep(TAKEOVER_LOAD_S)
            before = len(grants)
            t_kill = leader.kill()
            ready_s, body = await standby.wait_ready(timeout_s=120, since=t_kill)
            lr = body.get("last_replay") or {}
            log(f"takeover {rnd}/{rounds}: standby ready {ready_s:.3f} s after the kill (leader epoch "
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
            log(f"takeover {rnd}/{rounds}: worker resumed {t_resumed - t_kill:.3f} s after the kill (kept "
                 f"{resumed.kept} of {len(w.committed)} replicas), first lease from the new leader "
                 f"{first_grant:.3f} s after it")
            if resumed.kept != len(w.committed):
                log(f"WARNING: the resume kept {resumed.kept} replicas, the worker holds {len(w.committed)}")
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
