"""The worker's GPU memory metrics and the cache counters its heartbeats carry.

The CUDA path itself (``read_cuda``: torch.cuda's memory calls) needs a GPU and does not run
here; what is tested is the arithmetic from device stats and pool bytes to samples, with the
device read injected, and that a CPU worker exports no ``kvl_worker_gpu_*`` series at all."""

from __future__ import annotations

import pytest

from shared.messages import CacheCounters, Heartbeat, decode, encode
from tests.twin import InProcessCoordinator
from tests.worker.conftest import BS, prompt
from worker.metrics import GpuMemory, WorkerMetrics, gpu_families

GIB = 2**30


def samples(families) -> dict[str, tuple[dict[str, str], float]]:
    return {s.name: (s.labels, s.value) for f in families for s in f.samples}


def test_device_stats_and_pool_bytes_become_samples() -> None:
    mem = GpuMemory(allocated=40 * GIB, reserved=60 * GIB, total=80 * GIB, free=18 * GIB)
    got = samples(gpu_families("cuda:1", mem, 10 * GIB))
    assert got == {
        "kvl_worker_gpu_memory_allocated_bytes": ({"device": "cuda:1"}, 40 * GIB),
        "kvl_worker_gpu_memory_reserved_bytes": ({"device": "cuda:1"}, 60 * GIB),
        "kvl_worker_gpu_memory_total_bytes": ({"device": "cuda:1"}, 80 * GIB),
        "kvl_worker_gpu_memory_free_bytes": ({"device": "cuda:1"}, 18 * GIB),
        "kvl_worker_gpu_pool_bytes": ({"device": "cuda:1"}, 10 * GIB),
        "kvl_worker_gpu_pool_share_of_allocated": ({"device": "cuda:1"}, 0.25),
        "kvl_worker_gpu_pool_share_of_device": ({"device": "cuda:1"}, 0.125),
    }
    # nothing allocated yet (no pools, no weights): shares are 0, not a division error
    zero = samples(gpu_families("cuda:0", GpuMemory(0, 0, 80 * GIB, 80 * GIB), 0))
    assert zero["kvl_worker_gpu_pool_share_of_allocated"][1] == 0.0
    assert zero["kvl_worker_gpu_pool_share_of_device"][1] == 0.0


def test_a_cuda_worker_registers_gauges_read_at_scrape_time() -> None:
    m = WorkerMetrics()
    reads: list[str] = []
    state = {"allocated": 2 * GIB}

    def read(device: str) -> GpuMemory:
        reads.append(device)
        return GpuMemory(allocated=state["allocated"], reserved=3 * GIB, total=16 * GIB, free=12 * GIB)

    assert m.watch_gpu("cuda:0", GIB, read=read)
    assert reads == []    # registration does not touch the device (describe() has the names)
    assert m.value("kvl_worker_gpu_pool_share_of_allocated", {"device": "cuda:0"}) == 0.5
    state["allocated"] = 4 * GIB
    text = m.render().decode()
    assert 'kvl_worker_gpu_memory_allocated_bytes{device="cuda:0"} 4.294967296e+09' in text
    assert 'kvl_worker_gpu_pool_share_of_allocated{device="cuda:0"} 0.25' in text
    assert reads == ["cuda:0", "cuda:0"]


@pytest.mark.parametrize("device", ["cpu", "mps", "meta"])
def test_no_gpu_series_on_other_devices(device: str) -> None:
    m = WorkerMetrics()
    assert not m.watch_gpu(device, GIB, read=lambda _: pytest.fail("a CPU worker read a GPU"))
    assert "kvl_worker_gpu_" not in m.render().decode()


async def test_a_cpu_engine_exports_no_gpu_series_and_heartbeats_its_counters(make_engine) -> None:
    twin = InProcessCoordinator()
    async with make_engine(twin) as e:
        assert e.device.type == "cpu"
        # the pools' bytes a CUDA worker would report: every slot of every form, allocated once
        assert e.store.pools.nbytes() == sum(n * e.specs[f].bytes_per_block for f, n in e.slots.items()) > 0
        assert "kvl_worker_gpu_" not in e.metrics.render().decode()   # absent, not zero
        assert e.metrics.cache_counters() == CacheCounters()
        toks = prompt(100, seed=3)          # 6 whole blocks
        await e.generate(toks, max_tokens=1)
        await e.flush()
        await e.generate(toks, max_tokens=1)
        c = e.metrics.cache_counters()
        assert (c.queried, c.hits, c.validated) == (200, 6 * BS, 6 * BS)
        assert c.queried == e.metrics.value("kvl_worker_prefix_cache_queries_total")
        assert c.validated == e.metrics.value("kvl_worker_prefix_cache_validated_hits_total")
        e.metrics.fallbacks.labels(reason="grid").inc(2)
        e.metrics.fallbacks.labels(reason="not a name!").inc()   # never sent: it would void the heartbeat
        c = e.metrics.cache_counters()
        assert c.fallbacks == {"grid": 2}
        hb = Heartbeat(worker_id="w1", epoch=1, cache=c)
        assert decode(encode(hb), expect=Heartbeat) == hb
