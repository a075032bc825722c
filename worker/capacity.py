"""Whether the cache pools hold what the configuration asks of them, said where an operator looks.

A request whose lease the coordinator refuses for lack of room (``over_capacity``: every slot of
a form pinned by running requests, or the tenant's quota full) recomputes its prompt and caches
nothing — correct, slower, and silent unless said. Two places say it, each naming the key to
change:

* at start (:func:`capacity_shortfall`, logged as ``pool_capacity_low``): the pools hold fewer
  than ``service.max_concurrency`` requests of ``worker.capacity_check_tokens`` tokens at once;
* while serving (:class:`OverCapacityWatch`, logged as ``cache_over_capacity``): leases were
  refused with ``over_capacity`` during the last ``worker.capacity_warning_interval_s``
  (``kvl_worker_lease_errors_total{op="acquire",code="over_capacity"}``, the ``KvlCacheOverCapacity``
  alert's numerator).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from shared.config import Config
from shared.forms import FormCatalogue
from worker.settings import PoolSizing, blocks_per_request, bytes_to_hold, requests_admitted, size


@dataclass(frozen=True)
class Shortfall:
    """The pools hold ``held`` requests of ``tokens`` tokens where ``wanted`` may run at once."""
    held: int
    wanted: int
    tokens: int
    limited_by: str
    #: The smallest pool (bytes) that holds ``wanted`` of them.
    needed_bytes: int
    #: What to change, with the value that suffices.
    fix: str

    def message(self, sizing: PoolSizing) -> str:
        return (f"the cache pools ({size(sizing.pool_bytes)}, {sizing.how}) hold {self.held} request(s) of "
                f"{self.tokens:,} tokens (worker.capacity_check_tokens) at once, limited by form {self.limited_by}, "
                f"but service.max_concurrency is {self.wanted}: requests beyond {self.held} are refused their "
                f"leases (over_capacity) and recompute their prompts uncached. {self.fix}")


def capacity_shortfall(catalogue: FormCatalogue, cfg: Config, sizing: PoolSizing) -> Shortfall | None:
    """What the pools lack for ``service.max_concurrency`` requests of ``worker.capacity_check_tokens``
    (at most the maximum context) at once; None when they hold them, or the check is off (0)."""
    tokens = min(cfg.worker.capacity_check_tokens, sizing.max_context)
    wanted = cfg.service.max_concurrency
    if tokens <= 0 or not catalogue.forms:
        return None
    held, limited_by = requests_admitted(catalogue.forms, sizing.slots, sizing.block_size, tokens)
    if held >= wanted:
        return None
    need = bytes_to_hold(catalogue.forms, cfg, sizing.block_size, tokens, wanted, sizing.pool_bytes)
    w = cfg.worker
    if sizing.source == "worker.pool_bytes":
        raise_key = f"raise worker.pool_bytes to at least {need:,}"
    elif "worker.cpu_pool_max_bytes" in sizing.how:
        raise_key = f"raise worker.cpu_pool_max_bytes to at least {need:,}"
    else:
        share = min(1.0, w.cache_memory_fraction * need / max(1, sizing.pool_bytes))
        raise_key = (f"raise worker.cache_memory_fraction to about {share:.2f}" if share < 1.0 else
                     "free memory") + f" or set worker.pool_bytes to at least {need:,}"
    f = next(f for f in catalogue.forms if f.name == limited_by)
    per_request = blocks_per_request(f.scope, f.window_tokens, sizing.block_size, tokens)
    fix = (f"Fix: {raise_key} (one such request needs {per_request:,} blocks of {limited_by}), or lower "
           f"service.max_concurrency to {max(1, held)}.")
    return Shortfall(held, wanted, tokens, limited_by, need, fix)


def over_capacity_refusals(metrics: Any) -> float:
    """Leases the coordinator refused this worker for lack of room, so far."""
    return metrics.value("kvl_worker_lease_errors_total", {"op": "acquire", "code": "over_capacity"})


class OverCapacityWatch:
    """Every ``interval_s``: when leases were refused ``over_capacity`` since the last look, one
    warning with their count and the fix (one line per interval, however many requests fell back)."""

    def __init__(self, metrics: Any, fix: str, interval_s: float, log: Any) -> None:
        self.metrics, self.fix, self.interval_s, self.log = metrics, fix, interval_s, log
        self._seen = over_capacity_refusals(metrics)
        self._task: asyncio.Task[None] | None = None

    def check(self) -> int:
        """Warn if refusals were counted since the last check; how many."""
        now = over_capacity_refusals(self.metrics)
        new, self._seen = int(now - self._seen), now
        if new > 0:
            self.log.warning("cache_over_capacity", refused_leases=new, interval_s=self.interval_s,
                             total=int(now), fix=self.fix,
                             note="these requests recomputed their prompts and cached nothing "
                                  "(kvl_worker_lease_errors_total{code=\"over_capacity\"})")
        return new

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="over-capacity-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def serving_fix(shortfall: Shortfall | None, sizing: PoolSizing | None) -> str:
    """The fix a serving-time warning names: the start-up one when there was one, else the pool's
    key; and a tenant's quota, which the coordinator also refuses as ``over_capacity``."""
    if shortfall is not None:
        fix = shortfall.fix
    else:
        key = ("worker.pool_bytes" if sizing is None or sizing.source == "worker.pool_bytes" else
               "worker.cpu_pool_max_bytes" if "worker.cpu_pool_max_bytes" in sizing.how else
               "worker.cache_memory_fraction (or set worker.pool_bytes)")
        fix = f"Fix: raise {key}, or lower service.max_concurrency."
    return (fix + " If one tenant is at its quota: raise its cache_quota_blocks (auth.keys) or "
            "coordinator.tenant_quota_replicas.")


def capacity_ctx(engine: Any, cfg: Config, log: Any) -> Any:
    """An aiohttp ``cleanup_ctx``: the start-up check when the app starts, the serving watch while
    it runs (nothing for a worker without a cache)."""
    async def ctx(_app: Any) -> Any:
        sizing = engine.sizing
        if sizing is None:
            yield
            return
        shortfall = capacity_shortfall(engine.catalogue, cfg, sizing)
        if shortfall is not None:
            log.warning("pool_capacity_low", requests_held=shortfall.held, max_concurrency=shortfall.wanted,
                        check_tokens=shortfall.tokens, limited_by=shortfall.limited_by,
                        pool_bytes=sizing.pool_bytes, needed_pool_bytes=shortfall.needed_bytes,
                        message=shortfall.message(sizing))
        watch = OverCapacityWatch(engine.metrics, serving_fix(shortfall, sizing),
                                  cfg.worker.capacity_warning_interval_s, log)
        watch.start()
        try:
            yield
        finally:
            await watch.stop()
    return ctx
