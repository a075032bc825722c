"""Cache pools sized from memory (``worker.pool_bytes`` unset): what the worker logs at start,
an explicit ``pool_bytes`` winning, a pool too small for one request of the maximum context
refused with its numbers (in the engine and by the worker process), and ``kvledger plan``
saying the same before a start. The memory read is this machine's real ``MemAvailable``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.twin import InProcessCoordinator
from tests.worker.conftest import config
from worker.engine import Engine
from worker.settings import PoolSizeError, available_memory, blocks_per_request, pool_slots

MiB = 2**20
ROOT = Path(__file__).parents[2]


def sized(logs: list[dict]) -> dict:
    (line,) = [e for e in logs if e["event"] == "pools_sized"]
    return line


async def test_sized_from_memory_logs_what_it_holds(model, tmp_path) -> None:
    """Capped on a CPU: exactly worker.cpu_pool_max_bytes, and the log line says per form how many
    blocks and tokens that is and how many requests of the maximum context it holds."""
    cfg = config(tmp_path, **{"worker.pool_bytes": None, "worker.cpu_pool_max_bytes": 8 * MiB,
                              "worker.capacity_check_tokens": 0})     # no concurrency floor: the cap binds
    with capture_logs() as logs:
        e = Engine(model, cfg, InProcessCoordinator())
    try:
        line = sized(logs)
        assert line["log_level"] == "info" and line["source"] == "memory" and line["pool_bytes"] == 8 * MiB
        assert "MemAvailable" in line["how"] and "capped at worker.cpu_pool_max_bytes 8.0 MiB" in line["how"]
        assert e.slots == pool_slots(e.catalogue, cfg, 8 * MiB) and set(e.slots) == set(e.catalogue.names)
        assert line["forms"] == {n: {"blocks": k, "tokens": k * 16} for n, k in e.slots.items()}
        assert line["max_context"] == e.max_context == 4096
        # the count, by hand: each form's slots over what one request of 4096 tokens holds of it
        per_form = {f.name: e.slots[f.name] // blocks_per_request(f.scope, f.window_tokens, 16, 4096)
                    for f in e.catalogue.forms}
        assert line["requests_at_max_context"] == min(per_form.values()) > 0
        assert per_form[line["limited_by"]] == line["requests_at_max_context"]
        assert sum(p.storage.numel() for p in e.store.pools.pools.values()) <= 8 * MiB
        # where an operator looks: the same numbers as gauges
        assert e.metrics.value("kvl_worker_pool_bytes") == 8 * MiB
        assert e.metrics.value("kvl_worker_pool_max_context_requests") == line["requests_at_max_context"]
    finally:
        await e.stop()


async def test_uncapped_takes_the_fraction_of_available_memory(model, tmp_path) -> None:
    before = available_memory("cpu")[0]
    cfg = config(tmp_path, **{"worker.pool_bytes": None, "worker.cpu_pool_max_bytes": 0,
                              "worker.cache_memory_fraction": 0.001})
    with capture_logs() as logs:
        e = Engine(model, cfg, InProcessCoordinator())
    after = available_memory("cpu")[0]
    try:
        line = sized(logs)
        # MemAvailable moves with every other process on the machine: within 1 GiB of ours either way
        lo, hi = (min(before, after) - 2**30) * 0.001, (max(before, after) + 2**30) * 0.001
        assert lo <= line["pool_bytes"] <= hi and "capped" not in line["how"]
        assert e.slots == pool_slots(e.catalogue, cfg, line["pool_bytes"])
    finally:
        await e.stop()


async def test_explicit_pool_bytes_wins(model, tmp_path) -> None:
    cfg = config(tmp_path, **{"worker.pool_bytes": 3 * MiB, "worker.cpu_pool_max_bytes": 64 * MiB,
                              "worker.cache_memory_fraction": 0.5})
    with capture_logs() as logs:
        e = Engine(model, cfg, InProcessCoordinator())
    try:
        line = sized(logs)
        assert line["source"] == "worker.pool_bytes" and line["pool_bytes"] == 3 * MiB
        assert e.slots == pool_slots(e.catalogue, cfg)
    finally:
        await e.stop()


async def test_explicit_pool_too_small_warns_and_serves(model, tmp_path) -> None:
    """The operator's own pool_bytes below one request of the maximum context: a warning with the
    numbers (tests and drills use such pools on purpose), not a refusal."""
    cfg = config(tmp_path, **{"worker.pool_bytes": 100_000})
    with capture_logs() as logs:
        e = Engine(model, cfg, InProcessCoordinator())
    try:
        line = sized(logs)
        assert line["log_level"] == "warning" and line["requests_at_max_context"] == 0 and line["limited_by"]
        assert e.metrics.value("kvl_worker_pool_max_context_requests") == 0
    finally:
        await e.stop()


def test_memory_sized_pool_too_small_refuses_with_numbers(model, tmp_path) -> None:
    cfg = config(tmp_path, **{"worker.pool_bytes": None, "worker.cpu_pool_max_bytes": 200_000,
                              "worker.capacity_check_tokens": 0})
    with pytest.raises(PoolSizeError) as err:
        Engine(model, cfg, InProcessCoordinator())
    msg = str(err.value)
    assert "capped at worker.cpu_pool_max_bytes" in msg and "one request of the maximum context (4,096 tokens" in msg
    assert "needs 256" in msg and "set worker.pool_bytes" in msg      # the compressed form: 4096 / 16 blocks


def test_worker_process_refuses_with_the_numbers(tmp_path) -> None:
    """The real worker process: exit 2 and one line on stderr, no stack trace."""
    conf = tmp_path / "kvledger.yaml"
    conf.write_text("worker:\n  worker_id: w1\n  cpu_pool_max_bytes: 200000\n  capacity_check_tokens: 0\n"
                    f"nats:\n  url: nats://127.0.0.1:1\nstate_dir: {tmp_path / 'state'}\n")
    out = subprocess.run([sys.executable, "-m", "worker", "--config", str(conf)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "kvledger worker: the cache pools sized from memory" in out.stderr and "needs 256" in out.stderr
    assert "Traceback" not in out.stderr


async def test_plan_says_what_the_worker_sizes(model, tmp_path, capsys) -> None:
    """``kvledger plan`` with the worker's config: the same pool, slots and requests at the maximum
    context as the engine logs (the cap binds, so MemAvailable's drift cannot part them)."""
    from kvledger.cli import main

    over = {"worker.pool_bytes": None, "worker.cpu_pool_max_bytes": 6 * MiB, "worker.capacity_check_tokens": 0}
    e = Engine(model, config(tmp_path, **over), InProcessCoordinator())
    await e.stop()
    capsys.readouterr()     # the engine's own log lines
    conf = tmp_path / "kvledger.yaml"
    conf.write_text("worker:\n  cpu_pool_max_bytes: 6291456\n  capacity_check_tokens: 0\n")
    assert main(["--config", str(conf), "plan", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pool_source"] == "memory" and doc["pool_bytes"] == 6 * MiB
    assert "memory-sized" in doc["budget"] and "MemAvailable" in doc["budget"]
    assert {f["name"]: f["slots"] for f in doc["forms"]} == e.slots
    assert doc["max_context"] == e.max_context
    assert doc["requests_at_max_context"] == e.sizing.admitted > 0


async def test_the_cpu_cap_rises_to_hold_twice_the_concurrency(model, tmp_path) -> None:
    """A cap under what ``service.max_concurrency`` requests of ``worker.capacity_check_tokens`` need
    (twice: those running and what they leave for their next turns) is raised to exactly that, and
    says so; with memory too short for it the start-up check names the memory fraction, not the cap."""
    from worker.capacity import capacity_shortfall
    from worker.settings import bytes_to_hold, requests_admitted, size_pools

    cfg = config(tmp_path, **{"worker.pool_bytes": None, "worker.cpu_pool_max_bytes": 1 * MiB,
                              "service.max_concurrency": 6, "worker.capacity_check_tokens": 512})
    e = Engine(model, cfg, InProcessCoordinator())
    try:
        need = bytes_to_hold(e.catalogue.forms, cfg, 16, 512, 12)
        assert e.sizing.pool_bytes == need > 1 * MiB
        assert "to hold 2 × service.max_concurrency 6 requests of 512 tokens" in e.sizing.how
        assert requests_admitted(e.catalogue.forms, e.slots, 16, 512)[0] >= 12
        assert requests_admitted(e.catalogue.forms, pool_slots(e.catalogue, cfg, need - 1), 16, 512)[0] < 12
        assert capacity_shortfall(e.catalogue, cfg, e.sizing) is None
        # memory too short for even the running requests: the fix is memory or pool_bytes, not the cap
        short = size_pools(e.catalogue, cfg, "cpu", e.max_context, available=(need // 4, "MemAvailable"))
        gap = capacity_shortfall(e.catalogue, cfg, short)
        assert gap is not None and gap.held < 6 and "set worker.pool_bytes to at least" in gap.fix
        assert "cpu_pool_max_bytes" not in gap.fix
    finally:
        await e.stop()
