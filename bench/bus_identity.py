"""What identity on the bus costs: a NATS request round trip with per-user permissions vs without.

Every lease a worker asks for is a NATS request from its own user, checked by the server
against its publish permissions, answered under ``allow_responses`` into its own inbox
(``shared.nats_auth``). This measures that path against the same traffic on a server without
users, both embedded nats-servers started by this run, in alternating rounds (the machine is
noisy): a responder connected as ``coordinator`` answers ``<p>.req.<w>.acquire`` from a
requester connected as ``worker.<w>`` — once one at a time (latency), once 64 in flight
(throughput), with a lease-sized payload.

    python -m bench.bus_identity            # 3 rounds of 2,000 serial + 20,000 pipelined requests
    python -m bench.bus_identity --quick    # 1 round, a tenth of the requests

The last line printed is one JSON object: ``plain_serial_p50_ms``, ``auth_serial_p50_ms``,
``auth_serial_ratio`` (auth ÷ plain, 1.0 = free), ``plain_per_s``, ``auth_per_s``,
``auth_throughput_ratio`` (auth ÷ plain), ``auth_connect_ms`` / ``plain_connect_ms`` (a client's
connect, password check included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors

from shared import nats_auth
from shared.embedded import EmbeddedNats
from shared.subjects import COORDINATOR_QUEUE, Subjects

SUBJECTS = Subjects("kvlbench")
WORKER = "w0"
#: About a LeaseAcquire of an 8-block prompt.
PAYLOAD = b"x" * 900


def _log(msg: str) -> None:
    print(f"[bus_identity] {msg}", file=sys.stderr, flush=True)


async def _connect(url: str, store: nats_auth.CredentialStore | None, ident: nats_auth.Identity) -> Any:
    kw = {} if store is None else {"user": ident.user, "password": store.password(ident),
                                   "inbox_prefix": nats_auth.inbox_prefix(ident.user)}
    return await nats.connect(url, allow_reconnect=False, pending_size=64 * 2**20, **kw)


async def _first_answer(requester: Any, subject: str, within_s: float = 5.0) -> None:
    """Wait until the responder's interest reaches the requester's path.

    CI once saw the first request of a round answered "no responders" although the responder
    had subscribed and flushed first (not reproduced in 100 local rounds, idle or loaded); a
    worker takes the same answer as "coordinator unavailable" and carries on. A path that never
    answers (a permission that denies it) still fails after ``within_s``.
    """
    deadline = time.monotonic() + within_s
    while True:
        try:
            await requester.request(subject, PAYLOAD, timeout=5)
            return
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            _log("no responders yet; retrying")
            await asyncio.sleep(0.05)


async def _round(url: str, store: nats_auth.CredentialStore | None, serial: int, piped: int,
                 inflight: int) -> dict[str, float]:
    t0 = time.perf_counter()
    requester = await _connect(url, store, nats_auth.worker(WORKER))
    connect_ms = 1000 * (time.perf_counter() - t0)
    responder = await _connect(url, store, nats_auth.Identity("coordinator"))
    try:
        async def answer(msg: Any) -> None:
            await msg.respond(msg.data[:200])

        # as the coordinator answers: in its queue group, the only way its identity may subscribe there
        await responder.subscribe(SUBJECTS.requests_wildcard("acquire"), queue=COORDINATOR_QUEUE, cb=answer)
        await responder.flush()
        subject = SUBJECTS.request("acquire", WORKER)
        await _first_answer(requester, subject)
        for _ in range(50):   # warm-up
            await requester.request(subject, PAYLOAD, timeout=5)
        lat = []
        for _ in range(serial):
            t = time.perf_counter()
            await requester.request(subject, PAYLOAD, timeout=5)
            lat.append(time.perf_counter() - t)
        sem = asyncio.Semaphore(inflight)

        async def one() -> None:
            async with sem:
                await requester.request(subject, PAYLOAD, timeout=10)

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(piped)))
        wall = time.perf_counter() - t
        return {"p50_ms": 1000 * statistics.median(lat), "per_s": piped / wall, "connect_ms": connect_ms}
    finally:
        await requester.close()
        await responder.close()


async def run(rounds: int, serial: int, piped: int, inflight: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvl-bus-identity-") as tmp:
        root = Path(tmp)
        store = nats_auth.CredentialStore(root / "credentials")
        conf = store.write_server_config([nats_auth.worker(WORKER)], SUBJECTS)
        servers = {"plain": (EmbeddedNats(root / "plain").start(), None),
                   "auth": (EmbeddedNats(root / "auth", config_file=str(conf)).start(), store)}
        try:
            got: dict[str, list[dict[str, float]]] = {"plain": [], "auth": []}
            for r in range(rounds):
                for name in (("plain", "auth") if r % 2 == 0 else ("auth", "plain")):
                    srv, creds = servers[name]
                    res = await _round(srv.url, creds, serial, piped, inflight)
                    got[name].append(res)
                    _log(f"round {r + 1}/{rounds} {name:5}: serial p50 {res['p50_ms']:.3f} ms, "
                         f"{res['per_s']:,.0f}/s at {inflight} in flight, connect {res['connect_ms']:.1f} ms")
        finally:
            for srv, _ in servers.values():
                srv.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in got[name])

    out = {f"{n}_{k}": round(med(n, k), 0 if k == "per_s" else 3) for n in ("plain", "auth")
           for k in ("p50_ms", "per_s", "connect_ms")}
    out = {k.replace("_p50_ms", "_serial_p50_ms"): v for k, v in out.items()}
    out["auth_serial_ratio"] = round(out["auth_serial_p50_ms"] / out["plain_serial_p50_ms"], 3)
    out["auth_throughput_ratio"] = round(out["auth_per_s"] / out["plain_per_s"], 3)
    out.update(rounds=rounds, serial_requests=serial, pipelined_requests=piped, inflight=inflight)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.bus_identity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, a tenth of the requests")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per server (default 3, --quick 1)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    scale = 10 if args.quick else 1
    out = asyncio.run(run(rounds, 2000 // scale, 20000 // scale, 64))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
