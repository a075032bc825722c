"""``python -m bench.fleet``: the options, one round per shard count, and the result."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench.fleet
from bench.fleet.cluster import DriverProc, log, shards
from bench.fleet.mix import MixParams
from bench.fleet.report import ROLES, fleet_keys, goals, table
from bench.proc_cpu import cpu_spent, stack_cpu


def _by_role(spent: dict[str, float]) -> dict[str, float]:
    """CPU seconds per :data:`~bench.fleet.report.ROLES` role (``coordinator<k>`` and ``driver<i>`` summed)."""
    out = dict.fromkeys(ROLES, 0.0)
    for role, s in spent.items():
        out["coordinators" if role.startswith("coordinator") else "drivers" if role.startswith("driver") else role] += s
    return out


def _sum_counts(parts: list[dict[str, Any]], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"leases_by_shard": [0] * n, "blocks_read": 0, "blocks_written": 0, "wrong_shard": 0,
                           "errors": {}, "heartbeats": 0}
    for p in parts:
        for k, v in p["leases"].items():
            out["leases_by_shard"][int(k)] += v
        for k in ("blocks_read", "blocks_written", "wrong_shard", "heartbeats"):
            out[k] += p[k]
        for k, v in p["errors"].items():
            out["errors"][k] = out["errors"].get(k, 0) + v
    return out


async def one_round(args: argparse.Namespace, nc: Any, db_url: str, nats_url: str, tmp: Path, n: int,
                    made: dict[str, list[str]]) -> dict[str, Any]:
    """N shards, the fleet driven against them: the timed window's counts and CPU, and the run's."""
    t0 = time.perf_counter()
    workers = args.workers_per_shard * n if args.workers_per_shard else args.workers
    async with shards(nc, db_url, nats_url, tmp, n, args.partitions, made) as (prefix, coords):
        log(f"{n} shard(s) ready in {time.perf_counter() - t0:.1f} s (prefix {prefix}); "
            f"{workers} workers in {args.drivers} driver process(es) joining every shard ...")
        per = -(-workers // args.drivers)
        drivers: list[DriverProc] = []
        try:
            for i in range(args.drivers):
                count = min(per, workers - i * per)
                if count <= 0:
                    break
                drivers.append(DriverProc({
                    "nats_url": nats_url, "prefix": prefix, "shards": n, "first": i * per, "count": count,
                    "namespaces": args.namespaces, "connections": args.connections, "pool_slots": args.pool_slots,
                    "seed": args.seed, "warmup_s": args.warmup, "mix": dataclasses.asdict(MixParams(prompts=args.prompts)),
                }, tmp / f"n{n}-driver{i}.log"))
            await asyncio.gather(*(d.expect("joined", 300) for d in drivers))
            pids = {**{f"coordinator{k}": c.pid or -1 for k, c in enumerate(coords)},
                    **{f"driver{i}": d.pid for i, d in enumerate(drivers)}}
            # The fleet idle: every worker a member of every shard, heartbeating, no turns. What it
            # costs per second is paid whatever the lease rate (heartbeats: workers × shards per s).
            await asyncio.sleep(1)
            idle0, t_idle = stack_cpu(pids), time.perf_counter()
            await asyncio.sleep(args.idle)
            idle = _by_role(cpu_spent(idle0, stack_cpu(pids)))
            idle_wall = time.perf_counter() - t_idle
            for d in drivers:
                d.send("start")
            await asyncio.gather(*(d.expect("ready", 300) for d in drivers))
            log(f"warm; counting {args.seconds:.0f} s ...")
            appends0 = await asyncio.gather(*(c.append_stats() for c in coords))
            cpu0 = stack_cpu(pids)
            t_go = time.perf_counter()
            for d in drivers:
                d.send("go")
            await asyncio.sleep(args.seconds)
            marks = [await d.ask("mark") for d in drivers]
            wall = time.perf_counter() - t_go
            spent = cpu_spent(cpu0, stack_cpu(pids))
            appends1 = await asyncio.gather(*(c.append_stats() for c in coords))
            totals = [await d.ask("exit") for d in drivers]
        finally:
            for d in drivers:
                d.stop()
        alive = [c.popen is not None and c.popen.poll() is None for c in coords]
        takeovers = sum(c.log_events("leadership_lost") for c in coords)
    window = _sum_counts(marks, n)
    run = _sum_counts(totals, n)
    if not all(alive):
        run["errors"]["coordinator_exited"] = alive.count(False)
    if takeovers:
        run["errors"]["leadership_lost"] = takeovers
    r = {"shards": n, "workers": workers, "wall_s": wall, "cpu_s": _by_role(spent), **window,
         "idle_cpu_s_per_s": {k: v / idle_wall for k, v in idle.items()},
         # the coordinators' group-commit appends (transactions, events) over the window
         "append_txs": sum(b[0] - a[0] for a, b in zip(appends0, appends1)),
         "append_events": sum(b[1] - a[1] for a, b in zip(appends0, appends1)),
         "run_leases_by_shard": run["leases_by_shard"], "run_wrong_shard": run["wrong_shard"],
         "run_errors": run["errors"]}
    leases = sum(window["leases_by_shard"])
    log(f"{n} shard(s): {leases} leases in {wall:.1f} s ({leases / wall:,.0f}/s), by shard {window['leases_by_shard']}; "
        f"CPU s {({k: round(v, 2) for k, v in r['cpu_s'].items()})}; wrong_shard {run['wrong_shard']}, "
        f"errors {run['errors'] or 0}")
    return r


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    from bench.cli import services
    from bench.coordinator.harness import pg_facts

    load0 = os.getloadavg()
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="kvl-bench-fleet-"))
    rounds: list[dict[str, Any]] = []
    made: dict[str, list[str]] = {}
    ok = False
    try:
        async with services(args.database_url, args.nats_url, tmp / "services") as (db_url, nats_url):
            facts = await pg_facts(db_url)
            nc = await nats.connect(nats_url, name="bench.fleet")
            try:
                for n in args.shards:
                    rounds.append(await one_round(args, nc, db_url, nats_url, tmp, n, made))
            finally:
                with contextlib.suppress(Exception):
                    await nc.drain()
        ok = True
    finally:
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"logs kept in {tmp}")
    keys = fleet_keys(rounds)
    result: dict[str, Any] = {
        "quick": args.quick, "shards": args.shards,
        "workers": f"{args.workers_per_shard} per shard" if args.workers_per_shard else args.workers, "drivers": args.drivers,
        "connections_per_driver": args.connections, "namespaces": args.namespaces, "prompts": args.prompts,
        "pool_slots": args.pool_slots, "partitions": args.partitions, "warmup_s": args.warmup,
        "seconds": args.seconds, "idle_s": args.idle, **facts, **keys,
        # the whole run's (warm-up and wind-down included): a refusal or error anywhere counts
        "run_wrong_shard": sum(r["run_wrong_shard"] for r in rounds),
        "run_errors": {f"shards{r['shards']}": r["run_errors"] for r in rounds},
        "run_leases_by_shard": {f"shards{r['shards']}": r["run_leases_by_shard"] for r in rounds},
        "cpu_counted": "every process's user+system CPU over the timed window: the N coordinator processes, "
                       "the driver processes, every postgres and nats-server process on the machine "
                       "(bench.proc_cpu.stack_cpu, as bench.serving), and this process",
        "made_and_removed": made,
        "goals": goals(keys, args.shards, sum(r["run_wrong_shard"] for r in rounds),
                       sum(sum(r["run_errors"].values()) for r in rounds)),
        "wall_s": round(time.perf_counter() - t_start, 1), "load_avg_start": [round(x, 2) for x in load0],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
    }
    print(table(keys, args.shards), file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet", description=bench.fleet.__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few workers, short phases: well within a minute")
    ap.add_argument("--shards", default="1,2,4", help="shard counts, one round each (default 1,2,4; 1 is needed "
                                                      "for scaling_efficiency)")
    ap.add_argument("--workers", type=int, help="simulated workers (default 200, quick 16)")
    ap.add_argument("--workers-per-shard", type=int,
                    help="instead of --workers: this many per shard, so the fleet grows with the shards "
                         "(each shard's load as at one shard: the fleet on N times the machines)")
    ap.add_argument("--drivers", type=int, help="driver processes the workers are split between (default 2, quick 1)")
    ap.add_argument("--connections", type=int, default=4, help="NATS connections per driver process (default 4)")
    ap.add_argument("--namespaces", type=int, default=4, help="models: the workers are split between them (default 4)")
    ap.add_argument("--prompts", type=int, default=8, help="shared system prompts per namespace (default 8)")
    ap.add_argument("--pool-slots", type=int, default=1024,
                    help="GPU pool slots per worker, shared out between the shards (default 1024)")
    ap.add_argument("--partitions", type=int, default=256, help="coordinator.shard_partitions (default 256)")
    ap.add_argument("--warmup", type=float, help="seconds driven before counting (default 10, quick 2)")
    ap.add_argument("--seconds", type=float, help="seconds counted per round (default 30, quick 4)")
    ap.add_argument("--idle", type=float, help="seconds the joined fleet's idle CPU is counted, before the turns "
                                               "(default 5, quick 2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--database-url", default=os.environ.get("KVL_DATABASE_URL", ""))
    ap.add_argument("--nats-url", default=os.environ.get("KVL_NATS_URL", ""))
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.drive:
        from bench.fleet.driver import main as drive
        drive(args.drive)
        return None
    try:
        args.shards = sorted({int(x) for x in args.shards.split(",")})
    except ValueError:
        ap.error("--shards: comma-separated shard counts, e.g. 1,2,4")
    if not args.shards or args.shards[0] < 1 or args.shards[-1] > args.partitions:
        ap.error("--shards: each from 1 to --partitions")
    args.workers = args.workers or (16 if args.quick else 200)
    args.drivers = args.drivers or (1 if args.quick else 2)
    args.warmup = args.warmup if args.warmup is not None else (2.0 if args.quick else 10.0)
    args.seconds = args.seconds or (4.0 if args.quick else 30.0)
    args.idle = args.idle or (2.0 if args.quick else 5.0)
    if args.workers < args.drivers or args.connections < 1:
        ap.error("--workers must be at least --drivers, and --connections at least 1")
    from bench.cli import run_and_print
    return run_and_print(run(args))
