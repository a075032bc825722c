"""The disk tier bounded by default and cleaned by age (``worker.cache.retention``, ``worker.disk_gc``), and its write
failures counted where an alert reads them (issue 55, item 8).

Engines run on the coordinator twin with a real offload directory on this machine's file
system; the bound is computed from the real ``statvfs``. The end-to-end test with real
coordinator and worker processes is ``tests/e2e/test_disk_retention_process.py``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml
from structlog.testing import capture_logs

from shared.messages import ReplicaState
from tests.segment_files import records, segment_files
from tests.twin import InProcessCoordinator
from tests.worker.conftest import config, prompt
from worker.cache.retention import free_bytes, resolve_at_start, with_offload_bound
from worker.disk_gc import DiskRetention
from shared.logging import get_logger

ROOT = Path(__file__).parents[2]
#: Small pools and no host tier: a few 100-token prompts push each other's blocks to disk.
SMALL = {"worker.pool_bytes": 400_000, "cache.compressed_pool_limit": 0.1, "cache.swa_pool_limit": 0.7,
         "cache.tail_pool_limit": 0.18, "cache.host_tier_bytes": 0, "cache.offload_segment_bytes": 16 * 1024}
LOG = get_logger("test.retention")


def test_default_bound_is_a_share_of_the_free_space(tmp_path) -> None:
    root = tmp_path / "offload"
    own = root / "segments" / "w1"
    own.mkdir(parents=True)
    (own / "00000001.kvs").write_bytes(b"\0" * 100_000)           # this worker's earlier segment counts
    (root / "segments" / "w2").mkdir()
    (root / "segments" / "w2" / "00000001.kvs").write_bytes(b"\0" * 50_000)   # another's does not
    cfg = config(tmp_path, **{"cache.offload_dir_share": 0.25})
    assert cfg.cache.offload_dir_bytes == 0
    before = free_bytes(root)
    got, how = with_offload_bound(cfg, "w1")
    after = free_bytes(root)
    lo, hi = int((min(before, after) + 100_000) * 0.25), int((max(before, after) + 100_000) * 0.25)
    assert lo - 2**20 <= got.cache.offload_dir_bytes <= hi + 2**20     # the file system moves with the machine
    assert "cache.offload_dir_share 0.25" in how and "free on" in how
    # an explicit bound wins; no disk tier, no bound
    explicit = config(tmp_path, **{"cache.offload_dir_bytes": 123_456})
    assert with_offload_bound(explicit, "w1")[0] is explicit
    none = config(None)
    assert with_offload_bound(none, "w1")[0] is none
    # a directory not made yet: its nearest existing parent's file system
    later = config(tmp_path, **{"cache.offload_dir": str(tmp_path / "not" / "yet")})
    assert with_offload_bound(later, "w1")[0].cache.offload_dir_bytes > 0


def test_a_bound_under_two_segments_is_warned_about_at_start(tmp_path) -> None:
    cfg = config(tmp_path, **{"cache.offload_dir_share": 1e-12})
    with capture_logs() as logs:
        got = resolve_at_start(cfg, "w1", LOG)
    (bounded,) = [e for e in logs if e["event"] == "offload_bounded"]
    assert bounded["bound_bytes"] == got.cache.offload_dir_bytes >= 1
    (small,) = [e for e in logs if e["event"] == "offload_disk_small"]
    assert small["log_level"] == "warning" and "cache.offload_dir_bytes" in small["fix"]
    with capture_logs() as logs:
        resolve_at_start(config(tmp_path), "w1", LOG)
    assert not [e for e in logs if e["event"] == "offload_disk_small"]


def _age(paths: list[Path], seconds: float) -> None:
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t))


async def test_segments_past_their_age_are_deleted_once_evicted(make_engine, tmp_path) -> None:
    twin = InProcessCoordinator()
    root = tmp_path / "offload"

    def ready_on_disk() -> set[tuple[str, str]]:
        return {k[:2] for k, r in twin.state.replicas.items() if k[2] == "disk" and r.state is ReplicaState.READY}

    async with make_engine(twin, worker_id="wa", **SMALL, **{"cache.offload_max_age_s": 3600}) as e:
        first = prompt(100, seed=70)
        await e.generate(first, max_tokens=1)
        for seed in range(71, 73):                       # push `first` out to disk
            await e.generate(prompt(100, seed=seed), max_tokens=1)
        assert await e.flush(timeout=10)
        # a lease pins first's disk replicas: their segment waits, the others older than an hour go
        s = await e.open(first, max_new_tokens=1)
        pinned = {(r.block_hash, r.form) for lease in s.leases for r in lease.grant.read if r.location == "disk"}
        assert pinned
        for seed in range(73, 78):
            await e.generate(prompt(100, seed=seed), max_tokens=1)
        assert await e.flush(timeout=10)
        files = segment_files(root)
        assert len(files) >= 3 and ready_on_disk()
        retention = DiskRetention(e.supervisor.disk, e.cfg.cache.offload_max_age_s, 60, LOG)
        assert await retention.collect_once() == 0                   # young: nothing goes
        current = e.tiers._writer.current                            # noqa: SLF001 - the one still appended to
        _age(files, 7200)
        with capture_logs() as logs:
            deleted = await retention.collect_once()
        assert deleted >= 1
        left = set(segment_files(root))
        assert current is None or current in left or not current.exists()
        held = {(r.header.block_hash, r.header.form) for r in records(root)}
        assert pinned <= held
        assert e.metrics.value("kvl_worker_disk_gc_segments_total", {"outcome": "expired"}) == deleted
        assert e.metrics.value("kvl_worker_disk_gc_segments_total", {"outcome": "pinned"}) >= 1
        assert e.metrics.value("kvl_worker_disk_gc_bytes_total") > 0
        assert [x for x in logs if x["event"] == "disk_segments_expired"]
        # the ledger evicted what went, before it went: every READY disk replica still has its record
        assert ready_on_disk() <= held
        assert any(k[2] == "disk" and r.state is ReplicaState.EVICTED for k, r in twin.state.replicas.items())

        await e.close(s)
        assert await retention.collect_once() >= 1                   # unpinned now: it goes too
        assert ready_on_disk() <= {(r.header.block_hash, r.header.form) for r in records(root)}
        assert pinned.isdisjoint(ready_on_disk())


async def test_no_age_limit_and_no_coordinator_delete_nothing(make_engine, tmp_path) -> None:
    async with make_engine(InProcessCoordinator(), worker_id="wa", **SMALL, **{"cache.offload_max_age_s": 0}) as e:
        for seed in range(80, 84):
            await e.generate(prompt(100, seed=seed), max_tokens=1)
        assert await e.flush(timeout=10)
        files = segment_files(tmp_path / "offload")
        _age(files, 10 * 86400)
        assert await DiskRetention(e.supervisor.disk, 0, 60, LOG).collect_once() == 0
        assert segment_files(tmp_path / "offload") == files


async def test_a_failed_disk_write_is_counted_for_the_alert(make_engine, tmp_path) -> None:
    """The writer's segment directory cannot be made (a file is in its place): the write fails,
    the tier is marked down, and kvl_worker_offload_failures_total{tier="disk"} counts it — the
    series the KvlOffloadWriteFailures alert reads."""
    root = tmp_path / "offload"
    (root / "segments").mkdir(parents=True)
    (root / "segments" / "wa").write_text("not a directory")
    async with make_engine(InProcessCoordinator(), worker_id="wa", **SMALL) as e:
        for seed in range(90, 94):
            await e.generate(prompt(100, seed=seed), max_tokens=1)
        await e.flush(timeout=10)
        assert e.metrics.value("kvl_worker_offload_failures_total", {"tier": "disk", "reason": "unavailable"}) >= 1
        assert e.tiers.disk_down_reason.startswith("offload write failed")
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    (rule,) = [r for g in alerts["groups"] for r in g["rules"] if r["alert"] == "KvlOffloadWriteFailures"]
    assert 'kvl_worker_offload_failures_total{tier="disk"}' in rule["expr"]
    assert "cache.offload_dir_share" in rule["annotations"]["description"]      # the fix, named
