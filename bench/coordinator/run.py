"""``python -m bench.coordinator``: the options, the run of the phases in order on fresh databases
and subject prefixes (cleaned up afterwards), and the goals each figure is judged by."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import bench.coordinator
from bench.coordinator.full_pool import FULL_POOL, full_pool_phase
from bench.coordinator.harness import (
    CACHED_BLOCKS, PHASES, PROMPT_BLOCKS, CoordinatorProc, create_db, drop_db, echo_serve, log, pg_facts,
)
from bench.coordinator.idle import idle_phase
from bench.coordinator.ingest import backlog_phase, ingest_compare_phase, ingest_phase
from bench.coordinator.leases import lease_phase
from bench.coordinator.replay import replay_and_restart
from bench.coordinator.synthetic_worker import BenchWorker


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
            log("starting embedded PostgreSQL and/or NATS ...")
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
            log(f"starting the coordinator (fresh database {name}, prefix {subjects.prefix}) ...")
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
            log(f"coordinator ready in {empty_s:.2f} s (empty log, schema created)")
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
                log(f"leases: a 16-block write grant on a full pool of {slots:,} slots (the core alone) ...")
                fp = await asyncio.to_thread(full_pool_phase, slots, grants)
                log(f"leases: full pool: {fp['grant_full_pool_us']} us per grant with the LRU index, "
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
                log(f"WARNING: the coordinator lost leadership {result['leadership_losses']} time(s) during the "
                     "run (see docs/BENCHMARKS.md); its figures include the takeovers")
            if coord.popen is not None and coord.popen.returncode not in (0, None):
                log(f"coordinator exited with {coord.popen.returncode}:\n{coord.tail()}")

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
                log(f"--- {p.name} coordinator log (tail) ---\n{p.tail()}")
        log(f"coordinator logs and state kept in {tmp}")
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
                    log(f"could not delete JetStream stream {stream}: {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                await nc.close()
        for name in dbs:
            try:
                await drop_db(db_url, name)
            except Exception as e:  # noqa: BLE001 - best effort, say so
                log(f"could not drop database {name}: {e}")
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


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(prog="python -m bench.coordinator", description=bench.coordinator.__doc__.split("\n\n")[0])
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
