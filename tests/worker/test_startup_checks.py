"""Start-up checks that the configured cache fits the machine (``worker.startup_checks``,
``worker.cache.retention``; issue 55, item 8).

The real worker process refuses pools larger than this machine's available RAM with the key to
change (exit 2, no stack trace); a host tier past the RAM left is a warning naming its key and
the worker runs; a disk bound past the offload file system's room is a warning naming
``cache.offload_dir_bytes``. The memory and disk numbers are this machine's real ones (psutil,
statvfs); the CUDA branch, which this machine has no device for, is checked on given numbers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from structlog.testing import capture_logs

from shared.logging import get_logger
from tests.twin import InProcessCoordinator
from tests.worker.conftest import config
from worker.cache.retention import free_bytes, resolve_at_start
from worker.engine import Engine
from worker.startup_checks import Memory, PoolMemoryError, check_memory, measure

ROOT = Path(__file__).parents[2]
MiB = 2**20
LOG = get_logger("test.startup_checks")


def test_the_worker_process_refuses_pools_larger_than_the_available_ram(tmp_path) -> None:
    too_big = 4 * psutil.virtual_memory().total
    conf = tmp_path / "kvledger.yaml"
    conf.write_text(f"worker:\n  worker_id: w1\n  pool_bytes: {too_big}\n"
                    f"nats:\n  url: nats://127.0.0.1:1\nstate_dir: {tmp_path / 'state'}\n")
    out = subprocess.run([sys.executable, "-m", "worker", "--config", str(conf)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "kvledger worker: the cache pools" in out.stderr and "larger than the available RAM" in out.stderr
    assert "set worker.pool_bytes to at most" in out.stderr and "Traceback" not in out.stderr


async def test_a_host_tier_past_the_available_ram_is_a_warning_and_the_worker_runs(model, tmp_path) -> None:
    host = 2 * psutil.virtual_memory().total
    cfg = config(tmp_path, **{"worker.pool_bytes": 8 * MiB, "cache.host_tier_bytes": host})
    with capture_logs() as logs:
        e = Engine(model, cfg, InProcessCoordinator())
    try:
        (w,) = [x for x in logs if x["event"] == "host_tier_exceeds_memory"]
        assert w["log_level"] == "warning" and f"cache.host_tier_bytes {host:,}" in w["fix"]
        assert "lower cache.host_tier_bytes to at most" in w["fix"]
        assert e.store is not None and e.tiers.host is not None
    finally:
        await e.stop()
    # a host tier that fits: no warning
    with capture_logs() as logs:
        e = Engine(model, config(tmp_path, **{"worker.pool_bytes": 8 * MiB, "cache.host_tier_bytes": 16 * MiB}),
                   InProcessCoordinator())
    await e.stop()
    assert not [x for x in logs if x["event"] == "host_tier_exceeds_memory"]


def test_this_machines_memory_and_the_cuda_branch_on_given_numbers() -> None:
    mem = measure("cpu")
    assert mem.on_cpu and mem.device_free == mem.ram_available > 0
    assert check_memory(mem.ram_available // 2, "worker.pool_bytes", 0, mem) == []
    gpu = Memory("cuda:0", device_free=10 * 2**30, ram_available=4 * 2**30)
    with pytest.raises(PoolMemoryError) as err:
        check_memory(12 * 2**30, "worker.pool_bytes 12,884,901,888", 0, gpu)
    assert "free memory on cuda:0 (10,240 MiB)" in str(err.value)
    assert f"set worker.pool_bytes to at most {10 * 2**30:,}" in str(err.value)
    # on a GPU the pools are not in RAM: only the host tier counts against it
    assert check_memory(8 * 2**30, "x", 3 * 2**30, gpu) == []
    (warning,) = check_memory(8 * 2**30, "x", 5 * 2**30, gpu)
    assert "lower cache.host_tier_bytes to at most 4,294,967,296" in warning


def test_a_disk_bound_past_the_file_systems_room_is_warned_about(tmp_path) -> None:
    root = tmp_path / "offload"
    over = 2 * (free_bytes(tmp_path) + 2**30)
    with capture_logs() as logs:
        resolve_at_start(config(tmp_path, **{"cache.offload_dir": str(root), "cache.offload_dir_bytes": over}),
                         "w1", LOG)
    (w,) = [x for x in logs if x["event"] == "offload_disk_short"]
    assert w["log_level"] == "warning" and w["bound_bytes"] == over and w["room_bytes"] < over
    assert "lower cache.offload_dir_bytes to at most" in w["fix"]
    with capture_logs() as logs:
        resolve_at_start(config(tmp_path, **{"cache.offload_dir": str(root), "cache.offload_dir_bytes": 64 * MiB}),
                         "w1", LOG)
    assert not [x for x in logs if x["event"] == "offload_disk_short"]
