"""The disk tier in real processes (issue 55, item 8): a worker started without
``cache.offload_dir_bytes`` bounds its segments by a share of the file system's free space and
says so; segments past ``cache.offload_max_age_s`` go, each only after the real coordinator
evicted what it holds (the ledger never lists a READY disk replica whose record is gone)."""

from __future__ import annotations

import asyncio
import json
import time

from tests.segment_files import records, segment_files
from tests.worker.conftest import prompt
from worker.cache.retention import free_bytes


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


async def test_worker_bounds_its_disk_by_default_and_deletes_by_age(cluster) -> None:
    cluster.start_coordinator()
    cluster.start_worker("wa", cache={"host_tier_bytes": 0, "offload_segment_bytes": 16 * 1024,
                                      "compressed_pool_limit": 0.1, "swa_pool_limit": 0.7, "tail_pool_limit": 0.18,
                                      "offload_max_age_s": 1, "offload_age_check_s": 0.3},
                         worker={"pool_bytes": 400_000})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wa")
    free = free_bytes(cluster.offload_dir)
    lines = [json.loads(ln) for ln in cluster.workers["wa"].log.read_text().splitlines() if ln.startswith("{")]
    (bounded,) = [e for e in lines if e.get("event") == "offload_bounded"]
    # half of the free space at its start (the machine's other writers move it a little)
    assert abs(bounded["bound_bytes"] - free * 0.5) < max(2**30, free * 0.05), (bounded, free)
    assert "cache.offload_dir_share 0.5" in bounded["how"]
    metrics = await cluster.debug("wa", "metrics")
    assert _metric(metrics, "kvl_worker_disk_bound_bytes") == bounded["bound_bytes"]

    for seed in range(30, 36):                  # small pools: each prompt pushes the last ones to disk
        await cluster.generate("wa", prompt(100, seed=seed), 1)
    assert await cluster.flush("wa")
    assert await cluster.replicas(location="disk", state="READY")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = await cluster.debug("wa", "metrics")
        if _metric(metrics, 'kvl_worker_disk_gc_segments_total{outcome="expired"}') >= 2:
            break
        await asyncio.sleep(0.3)
    else:
        raise AssertionError(f"no segment expired\n{cluster.logs()}")
    await asyncio.sleep(1.5)                    # every closed segment is past its age by now
    assert len(segment_files(cluster.offload_dir)) <= 1              # the one still appended to, at most
    held = {(r.header.block_hash, r.header.form) for r in records(cluster.offload_dir)}
    ready = {(r["block_hash"], r["form"]) for r in await cluster.replicas(location="disk", state="READY")}
    assert ready <= held, ready - held
    assert await cluster.replicas(location="disk", state="EVICTED")
