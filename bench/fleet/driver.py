"""A driver process of ``bench.fleet`` (``python -m bench.fleet --drive '<spec json>'``): a share of
the fleet's simulated workers over a few NATS connections, in one asyncio loop.

It talks to the bench on stdin/stdout, one line each way, so the bench can read every process's
CPU at the moments the counts are taken: ``joined`` → ``start`` → ``ready`` (every worker joined every shard, warm-up
done) → ``go`` (counts from now) → ``mark`` (a JSON line: the counts since ``go``; the workers keep
going, so the window ends at steady load) → ``exit`` (the workers stop after their current turn; a
JSON line with the whole run's counts, warm-up included). Before the turns, ``joined`` (every
worker a member of every shard, heartbeating, no turns yet) waits for ``start``: the bench reads
the fleet's idle CPU (heartbeats, the coordinators' timers) in between.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
from typing import Any

from bench.fleet.mix import MixParams, WorkerMix, namespace
from bench.fleet.sim_worker import FleetWorker, Tally


def delta(a: Tally, b: Tally) -> dict[str, Any]:
    """The counts of ``b`` since ``a`` (an earlier copy)."""
    out = Tally(leases=b.leases - a.leases, blocks_read=b.blocks_read - a.blocks_read,
                blocks_written=b.blocks_written - a.blocks_written, wrong_shard=b.wrong_shard - a.wrong_shard,
                errors=b.errors - a.errors, heartbeats=b.heartbeats - a.heartbeats)
    return out.as_dict()


async def _line() -> str:
    return (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip()


async def drive(spec: dict[str, Any]) -> None:
    import nats

    from shared.shard_store import ShardMapStore

    conns = [await nats.connect(spec["nats_url"], name=f"bench.fleet driver {spec['first']}.{i}")
             for i in range(spec["connections"])]
    shard_map = None
    if spec["shards"] > 1:
        # the map the coordinators follow, from the NATS KV bucket (as the real worker is to)
        shard_map = await ShardMapStore(conns[0].jetstream(), spec["prefix"]).get()
        if shard_map is None or shard_map.shards != spec["shards"]:
            raise RuntimeError(f"no {spec['shards']}-shard map stored for prefix {spec['prefix']}: {shard_map}")
    tally = Tally()
    params = MixParams(**spec["mix"])
    workers = []
    for i in range(spec["first"], spec["first"] + spec["count"]):
        wid = f"fw{i:04d}"
        ns = namespace(i % spec["namespaces"])
        workers.append(FleetWorker(conns[i % len(conns)], spec["prefix"], wid, ns, shard_map, spec["shards"],
                                   spec["pool_slots"], WorkerMix(ns, wid, params, seed=spec["seed"] * 100_003 + i),
                                   tally))
    gate = asyncio.Semaphore(16)

    async def join(w: FleetWorker) -> None:
        async with gate:
            await w.join()
    await asyncio.gather(*(join(w) for w in workers))
    print("joined", flush=True)
    if await _line() != "start":
        raise SystemExit("the bench went away")
    loops = [asyncio.create_task(w.run()) for w in workers]
    await asyncio.sleep(spec["warmup_s"])
    print("ready", flush=True)
    start = copy.deepcopy(tally)
    while (cmd := await _line()) != "exit":
        print(f"driver {spec['first']}: {cmd or 'end of input'}", file=sys.stderr, flush=True)
        if cmd == "go":
            start = copy.deepcopy(tally)
        elif cmd == "mark":
            print(json.dumps(delta(start, tally)), flush=True)
        elif not cmd:       # the bench went away
            break
    for w in workers:
        w.stopping = True
    done, pending = await asyncio.wait(loops, timeout=60)
    if pending:
        tally.errors["stuck_at_exit"] += len(pending)
        for t in pending:
            t.cancel()
    for w in workers:
        await w.stop()
    print(json.dumps(tally.as_dict()), flush=True)
    for nc in conns:
        await nc.drain()


def main(spec_json: str) -> None:
    import faulthandler

    from shared.logging import configure_logging
    faulthandler.enable()       # a crash says where, in the driver's log
    configure_logging("json", "warning")
    asyncio.run(drive(json.loads(spec_json)))


__all__ = ["delta", "drive", "main"]
