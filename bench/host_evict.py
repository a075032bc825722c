"""What the coordinator's host-tier eviction decisions cost (``HostEvict``, issue 17's pins).

A worker drops a host-tier LRU victim only after the coordinator has evicted its replica: one
request per spill batch, answered once its ``ReplicaEvicted`` events are durable. It runs in the
worker's spill loop, off every request's path; this measures what it costs the ledger.

A coordinator process on a fresh database; the bench plays one worker over NATS: it commits
``--blocks`` GPU replicas, copies each to its host tier (offload transitions through JetStream),
then asks to evict them ``--per-request`` at a time, one request after another, and reports the
latency of each request (p50, p99) and per block. ``--per-request`` defaults to the engine's
``SPILL_BATCH``; ``1`` shows a lone victim's round trip (the floor: one NATS round trip and one
durable append, as a lease alone). For comparison, the path it replaced reported each victim as
a JetStream transition, which the coordinator ingests at ~50–70 µs of its CPU each
(BENCHMARKS.md, Coordinator: ``ingest_cpu_us_per_op_coordinator``).

    python -m bench.host_evict [--blocks 2048] [--per-request 256]

Services as ``bench.coordinator``: ``--database-url`` / ``--nats-url`` or ``KVL_DATABASE_URL`` /
``KVL_NATS_URL``, embedded ones otherwise. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.cli import services
from bench.coordinator.harness import BLOCK, NS, CoordinatorProc, create_db, drop_db, h, pct
from bench.coordinator.synthetic_worker import BenchWorker, commit_blocks


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def offload_to_host(nc: Any, w: BenchWorker, hashes: list[str], first_commit_seq: int) -> None:
    """Copy every committed block to the worker's host tier (offload transitions), as a GPU
    eviction does; returns once the ledger has them (the commit watermark)."""
    from shared.ids import ROOT_HASH
    from shared.messages import ReplicaState, TransitionEvent, encode, now_ms
    js = nc.jetstream(timeout=30)
    ts = now_ms()
    for i, b in enumerate(hashes):
        w.emitted_seq += 1
        t = TransitionEvent(
            worker_id=w.worker_id, epoch=w.epoch, seq=w.emitted_seq, namespace=NS, block_hash=b,
            parent_hash=hashes[i - 1] if i else ROOT_HASH, token_start=BLOCK * i, token_end=BLOCK * (i + 1),
            form="compressed", location=f"host:{w.worker_id}", from_state=None, to_state=ReplicaState.READY,
            generation=0, checksum=f"{first_commit_seq + i:016x}",   # the checksum its commit carried
            block_size=BLOCK, model_name="bench", ts_ms=ts)
        await js.publish(w.subjects.events(w.worker_id), encode(t), headers={"Nats-Msg-Id": t.source_id})
    await w.wait_watermark(w.emitted_seq, 60)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvl-bench-host-evict-"))
    async with services(args.database_url, args.nats_url, tmp / "services") as (db_url, nats_url):
        return await measure(args, tmp, db_url, nats_url)


async def measure(args: argparse.Namespace, tmp: Path, db_url: str, nats_url: str) -> dict[str, Any]:
    import nats

    from shared.messages import DiskBlock, HostEvict, HostEvictReply, decode, encode
    from shared.subjects import Subjects

    nc = await nats.connect(nats_url, name="bench.host_evict")
    url, name = await create_db(db_url, "hostevict")
    subjects = Subjects(f"kvlhe{uuid.uuid4().hex[:8]}")
    coord = CoordinatorProc(tmp, "coordinator", url, nats_url, subjects.prefix).start()
    w = BenchWorker(nc, subjects, slots=2 * args.blocks)
    try:
        await coord.wait_ready()
        await w.register()
        hashes = [h(30_000_000 + i) for i in range(args.blocks)]
        first = w.emitted_seq + 1
        await commit_blocks(nc, w, hashes)
        await offload_to_host(nc, w, hashes, first)
        _log(f"{args.blocks} host replicas READY; evicting them {args.per_request} per request ...")
        lat: list[float] = []
        evicted = 0
        for i in range(0, args.blocks, args.per_request):
            msg = HostEvict(worker_id=w.worker_id, epoch=w.epoch,
                            blocks=[DiskBlock(block_hash=b, form="compressed") for b in hashes[i:i + args.per_request]])
            t0 = time.perf_counter()
            reply = decode((await nc.request(subjects.request("host_evict", w.worker_id), encode(msg), timeout=10)).data)
            lat.append(time.perf_counter() - t0)
            if not isinstance(reply, HostEvictReply) or reply.pinned:
                raise RuntimeError(f"host_evict refused or partial: {reply}")
            evicted += reply.evicted
        if evicted != args.blocks:
            raise RuntimeError(f"{evicted} of {args.blocks} host replicas evicted")
        p50 = pct(lat, 0.5)
        return {"blocks": args.blocks, "blocks_per_request": args.per_request, "requests": len(lat),
                "host_evict_p50_ms": round(1000 * p50, 3), "host_evict_p99_ms": round(1000 * pct(lat, 0.99), 3),
                "host_evict_us_per_block": round(1e6 * p50 / args.per_request, 1),
                "loadavg": [round(x, 2) for x in os.getloadavg()]}
    finally:
        w.stop()
        coord.stop()
        await nc.close()
        with contextlib.suppress(Exception):
            await drop_db(db_url, name)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from worker.engine import SPILL_BATCH
    ap = argparse.ArgumentParser(prog="python -m bench.host_evict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2048, help="host replicas to evict (default 2048)")
    ap.add_argument("--per-request", type=int, default=SPILL_BATCH,
                    help=f"blocks named per HostEvict (default SPILL_BATCH = {SPILL_BATCH})")
    ap.add_argument("--database-url", default=os.environ.get("KVL_DATABASE_URL", ""))
    ap.add_argument("--nats-url", default=os.environ.get("KVL_NATS_URL", ""))
    args = ap.parse_args(argv)
    from shared.messages import MAX_HOST_EVICT_BLOCKS
    if args.blocks < 1 or not 1 <= args.per_request <= MAX_HOST_EVICT_BLOCKS:
        ap.error(f"--blocks must be ≥ 1 and --per-request 1–{MAX_HOST_EVICT_BLOCKS}")
    from bench.cli import run_and_print
    return run_and_print(run(args))


if __name__ == "__main__":
    main()
