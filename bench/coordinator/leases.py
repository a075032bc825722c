"""Phase of ``bench.coordinator``: concurrent lease acquires and releases against the echo
responder's replies of the same sizes, and a few hundred one at a time."""

from __future__ import annotations

import random
import statistics
from typing import Any

from bench.coordinator.harness import (
    CACHED_BLOCKS, PROMPT_BLOCKS, CoordinatorProc, EchoProc, append_delta, cpu_delta, cpu_seconds, drive, h, log, pct,
    rate_summary,
)
from bench.coordinator.synthetic_worker import BenchWorker
from bench.proc_cpu import process_cpu


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

    log(f"leases: warm-up ({len(warm)} acquire + release) ...")
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
        log(f"leases: echo baseline, {n} requests, {inflight} in flight ...")
        echo_cpu0 = process_cpu(echo.popen.pid)
        e1 = await drive(nc, echo_subj["acq"], acq, inflight)
        echo_cpu = process_cpu(echo.popen.pid) - echo_cpu0
        log(f"leases: echo {n / e1[0]:,.0f}/s; now {n} LeaseAcquire ({PROMPT_BLOCKS} blocks, {CACHED_BLOCKS} "
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
        log(f"leases: acquire {ls['per_s']:,.0f}/s, p50 {ls['p50_ms']:.2f} ms, p99 {ls['p99_ms']:.2f} ms; "
             f"{appends}; {cpu}")
        e2 = await drive(nc, echo_subj["acq"], acq, inflight)
        log(f"leases: echo (again) {n / e2[0]:,.0f}/s")
        # One request at a time: the latency without queueing (group commit window + fsync).
        _, sel, _ = await drive(nc, echo_subj["acq"], serial, 1)
        _, sll, sgrants = await leases(serial, 1)
        await releases(sgrants)
        log(f"leases: one in flight: acquire p50 {1000 * pct(sll, 0.5):.2f} ms, p99 {1000 * pct(sll, 0.99):.2f} ms "
             f"(echo p50 {1000 * pct(sel, 0.5):.2f} ms)")

        rel_payloads = [encode(w.release(g.lease_id)) for g in grants]
        await drive(nc, echo_subj["rel"], wrel, inflight)
        r1 = await drive(nc, echo_subj["rel"], rel_payloads, inflight)
        rw, rl, _ = await releases(grants)
        rs = rate_summary(n, rw, rl)
        r2 = await drive(nc, echo_subj["rel"], rel_payloads, inflight)
        log(f"leases: release {rs['per_s']:,.0f}/s (echo {n / r1[0]:,.0f}/s, {n / r2[0]:,.0f}/s)")
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
