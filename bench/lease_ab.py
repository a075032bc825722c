"""Paired A/B of one lease at a time: two builds of the coordinator, requests alternated.

On this machine sequential runs of ``bench.coordinator`` move by ±20 % from one minute to the
next, more than most changes to the request path are worth. Here both builds run at once, each
its own coordinator process on its own fresh database and subject prefix, and the bench sends
one ``LeaseAcquire`` (12 cached blocks pinned, 4 written: ``bench.coordinator``'s lease shape) to
A, then one to B (the order flips every round), each released before the next — so both sample
the same machine, minute by minute. Each build's code is its checkout's; the Python packages are
this environment's.

    git worktree add /tmp/kvl-a <rev>          # and the same for B, or pass the working tree
    python -m bench.lease_ab --a /tmp/kvl-a --b . --requests 1500

The last line printed is one JSON object: ``a_p50_ms``, ``b_p50_ms``, quartiles and p99 of each,
and ``b_vs_a_p50`` (< 1: B is faster). Services as ``bench.coordinator``: ``--database-url`` /
``--nats-url`` or ``KVL_DATABASE_URL`` / ``KVL_NATS_URL``, embedded ones otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.cli import services
from bench.coordinator.harness import CACHED_BLOCKS, PROMPT_BLOCKS, CoordinatorProc, create_db, drop_db, h, pct
from bench.coordinator.synthetic_worker import BenchWorker, commit_blocks


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkout(path: str) -> Path:
    """A directory holding a kvledger coordinator, or a clear error."""
    p = Path(path).expanduser().resolve()
    if not (p / "coordinator" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"{path}: not a kvledger checkout (no coordinator/__main__.py)")
    return p


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvl-lease-ab-"))
    async with services(args.database_url, args.nats_url, tmp / "services") as (db_url, nats_url):
        return await alternate(args, tmp, db_url, nats_url)


async def alternate(args: argparse.Namespace, tmp: Path, db_url: str, nats_url: str) -> dict[str, Any]:
    import nats

    from shared.messages import LeaseGrant, LeaseReleased, decode, encode
    from shared.subjects import Subjects

    nc = await nats.connect(nats_url, name="bench.lease_ab")
    sides: list[tuple[str, CoordinatorProc, BenchWorker, list[str]]] = []
    dbs: list[str] = []
    try:
        for k, (label, repo) in enumerate((("a", args.a), ("b", args.b))):
            url, name = await create_db(db_url, f"ab{label}")
            dbs.append(name)
            subjects = Subjects(f"kvlab{uuid.uuid4().hex[:8]}")
            coord = CoordinatorProc(tmp, label, url, nats_url, subjects.prefix, repo=repo)
            sides.append((label, coord.start(), BenchWorker(nc, subjects, slots=4 * args.requests * PROMPT_BLOCKS),
                          [h(10_000_000 * (k + 1) + i) for i in range(256)]))
        for label, coord, w, cached in sides:
            await coord.wait_ready()
            await w.register()
            await commit_blocks(nc, w, cached)
            _log(f"{label}: {coord.repo} ready, {len(cached)} blocks cached")
        rng = random.Random(11)
        fresh = iter(range(50_000_000, 10**9))
        lat: dict[str, list[float]] = {label: [] for label, *_ in sides}
        t0 = time.perf_counter()
        for i in range(args.requests):
            for label, _, w, cached in (sides if i % 2 else sides[::-1]):
                s = rng.randrange(0, len(cached) - CACHED_BLOCKS)
                hashes = cached[s:s + CACHED_BLOCKS] + [h(next(fresh)) for _ in range(PROMPT_BLOCKS - CACHED_BLOCKS)]
                data = encode(w.acquire(hashes, write=True, reuse=True, request_id=f"ab{i}"))
                t = time.perf_counter()
                reply = await nc.request(w.subjects.request("acquire", w.worker_id), data, timeout=5)
                lat[label].append(time.perf_counter() - t)
                grant = decode(reply.data)
                if not isinstance(grant, LeaseGrant):
                    raise RuntimeError(f"{label}: acquire refused: {grant}")
                rel = await nc.request(w.subjects.request("release", w.worker_id),
                                       encode(w.release(grant.lease_id)), timeout=5)
                if not isinstance(decode(rel.data), LeaseReleased):
                    raise RuntimeError(f"{label}: release refused")
            if (i + 1) % 500 == 0:
                _log(f"{i + 1}/{args.requests} rounds ({time.perf_counter() - t0:.0f} s)")
        out: dict[str, Any] = {"requests_each": args.requests, "a": str(args.a), "b": str(args.b)}
        for label, xs in lat.items():
            for q, key in ((0.25, "p25"), (0.5, "p50"), (0.75, "p75"), (0.99, "p99")):
                out[f"{label}_{key}_ms"] = round(1000 * pct(xs, q), 3)
        out["b_vs_a_p50"] = round(out["b_p50_ms"] / out["a_p50_ms"], 3)
        out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        return out
    finally:
        for _, coord, w, _ in sides:
            w.stop()
            coord.stop()
        await nc.close()
        for name in dbs:
            with contextlib.suppress(Exception):
                await drop_db(db_url, name)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.lease_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=checkout, required=True, help="checkout of build A (the baseline)")
    ap.add_argument("--b", type=checkout, required=True, help="checkout of build B")
    ap.add_argument("--requests", type=int, default=1500, help="lone leases per build (default 1500)")
    ap.add_argument("--database-url", default=os.environ.get("KVL_DATABASE_URL", ""))
    ap.add_argument("--nats-url", default=os.environ.get("KVL_NATS_URL", ""))
    args = ap.parse_args(argv)
    if args.requests < 10:
        ap.error("--requests must be at least 10")
    from bench.cli import run_and_print
    return run_and_print(run(args))


if __name__ == "__main__":
    main()
