"""What the engine derives from the configuration: worker id, pool sizes, tenant salts.

Pool sizing (operations.md, "Cache sizing"): ``worker.pool_bytes`` when set; otherwise the memory
left after the weights — free device memory on a GPU (``torch.cuda.mem_get_info``), ``MemAvailable``
of ``/proc/meminfo`` on a CPU — × ``worker.cache_memory_fraction``, at most
``worker.cpu_pool_max_bytes`` on a CPU, or what holds twice ``service.max_concurrency`` requests
of ``worker.capacity_check_tokens`` where that is more (:func:`concurrency_floor`). :func:`size_pools` returns the slots per form with what
they hold (blocks, tokens, requests of the maximum context); ``kvledger plan`` uses the same
functions, so it says before a start what the worker will log at it.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from shared.config import Config, ConfigError
from shared.forms import FormCatalogue, FormScope

_TOKEN = re.compile(r"[^A-Za-z0-9_\-]")
MiB = 2**20


def worker_id(cfg: Config) -> str:
    """``worker.worker_id``, else ``<host>-<pid>`` (a NATS subject token either way)."""
    wid = cfg.worker.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    wid = _TOKEN.sub("-", wid)[:64]
    if not wid:
        raise ValueError("worker.worker_id: must contain letters, digits, '_' or '-'")
    return wid


def pool_slots(catalogue: FormCatalogue, cfg: Config, pool_bytes: int | None = None) -> dict[str, int]:
    """Slots per form from ``pool_bytes × service.cache_reserve_ratio × <form>_pool_limit``
    (``pool_bytes``: ``worker.pool_bytes`` unless given).

    Full-history forms (``compressed``, ``indexer``) grow together — a resume needs both for
    every block — so they split ``compressed_pool_limit`` into equal slot counts. A window
    form takes ``swa_pool_limit``, a resume-point form ``tail_pool_limit``. The shares of scopes
    a model does not declare go to those it does, in proportion (a dense model's one full-history
    form gets all three).
    """
    pool = cfg.worker.pool_bytes if pool_bytes is None else pool_bytes
    if pool is None:
        raise ConfigError("worker.pool_bytes is unset: size the pools with size_pools() (from memory)")
    return scope_slots(catalogue.forms, pool * cfg.service.cache_reserve_ratio, pool_limits(cfg))


def pool_limits(cfg: Config) -> dict:
    """Each scope's share of the cached forms' budget (``cache.<scope>_pool_limit``)."""
    c = cfg.cache
    return {FormScope.FULL_HISTORY: c.compressed_pool_limit, FormScope.WINDOW: c.swa_pool_limit,
            FormScope.RESUME_POINT: c.tail_pool_limit}


def scope_slots(forms, budget: float, limits: dict) -> dict[str, int]:
    """Slots per form: each scope's share of ``budget`` (``limits``, rescaled over the scopes
    present) split into equal slot counts among its forms (``forms`` have ``name``, ``scope``,
    ``bytes_per_block``; scopes compare by value)."""
    present = {str(s): frac for s, frac in limits.items() if any(str(f.scope) == str(s) for f in forms)}
    scale = sum(limits.values()) / sum(present.values()) if present and sum(present.values()) else 0.0
    out: dict[str, int] = {}
    for scope, frac in present.items():
        group = [f for f in forms if str(f.scope) == scope]
        per_block = sum(f.bytes_per_block for f in group)
        n = int(budget * frac * scale // per_block)
        for f in group:
            out[f.name] = n
    return out


# --- sizing from memory ----------------------------------------------------------------------------

def size(n: float) -> str:
    """``1,024 MiB``, ``0.6 MiB``; bytes below 100 KiB."""
    return f"{n / MiB:,.{0 if n >= 100 * MiB else 1}f} MiB" if n >= 100 * 1024 else f"{int(n):,} bytes"


class PoolSizeError(ConfigError):
    """Pools sized from memory too small for one request of the maximum context; the message
    gives the numbers and the keys to change."""


def blocks_per_request(scope: str, window_tokens: int, block_size: int, context: int) -> int:
    """Blocks of a form one request of ``context`` tokens holds: all of its blocks for a
    full-history form, those covering the last ``window − 1`` tokens for a window form (at most
    ``ceil((W−1)/B) + 1``), one for a resume-point form."""
    blocks = -(-context // block_size)
    if str(scope) == str(FormScope.WINDOW):
        return min(blocks, -(-window_tokens // block_size) + 1)
    if str(scope) == str(FormScope.RESUME_POINT):
        return 1
    return blocks


def requests_admitted(forms, slots: dict[str, int], block_size: int, context: int) -> tuple[int, str]:
    """Requests of ``context`` tokens the pools hold at once, and the form that limits it."""
    best: tuple[int, str] | None = None
    for f in forms:
        need = blocks_per_request(f.scope, f.window_tokens, block_size, context)
        n = slots.get(f.name, 0) // need if need else 10**18
        if best is None or n < best[0]:
            best = (n, f.name)
    return best or (0, "")


def bytes_to_hold(forms, cfg: Config, block_size: int, tokens: int, wanted: int, start: int = MiB) -> int:
    """The smallest pool that holds ``wanted`` requests of ``tokens`` at once (``forms`` as for
    :func:`scope_slots`): slots grow with the pool (floored per form), so bisect between ``start``
    and a doubling that suffices."""
    limits, reserve = pool_limits(cfg), cfg.service.cache_reserve_ratio

    def holds(pool: int) -> bool:
        return requests_admitted(forms, scope_slots(forms, pool * reserve, limits), block_size, tokens)[0] >= wanted
    lo, hi = max(1, start), max(2, start * 2)
    while not holds(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def concurrency_floor(forms, cfg: Config, block_size: int, max_context: int) -> tuple[int, str]:
    """The pool that holds twice ``service.max_concurrency`` requests of
    ``worker.capacity_check_tokens`` tokens (at most ``max_context``) at once — those running and
    as much again kept for their next turns — and what it holds, for people; ``(0, "")`` when the
    check is off or there are no forms. A CPU's cap (``worker.cpu_pool_max_bytes``) never goes
    below it. NOTE: a real model's cache must fit the concurrency the worker admits: under the
    1 GiB cap SmolLM2 in float32 held 14 requests of 1,024 tokens, and a c = 32 chat load evicted
    its own conversations between turns and recomputed them (a 0.61 hit rate of ~0.8 possible)."""
    tokens, running = min(cfg.worker.capacity_check_tokens, max_context), cfg.service.max_concurrency
    if tokens <= 0 or not forms:
        return 0, ""
    return (bytes_to_hold(forms, cfg, block_size, tokens, 2 * running),
            f"2 × service.max_concurrency {running} requests of {tokens:,} tokens (worker.capacity_check_tokens)")


def available_memory(device: Any) -> tuple[int, str]:
    """Bytes free for the pools now (the weights are loaded), and where the number comes from."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free), f"free memory on {dev}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free RAM (sysconf)"


def memory_pool_bytes(cfg: Config, device: Any, available: int,
                      floor: tuple[int, str] = (0, "")) -> tuple[int, str]:
    """The pool a worker without ``worker.pool_bytes`` takes out of ``available`` bytes, and how;
    on a CPU at most ``worker.cpu_pool_max_bytes``, or ``floor`` (:func:`concurrency_floor`) where
    that is larger."""
    import torch

    w = cfg.worker
    pool = int(available * w.cache_memory_fraction)
    how = f"{size(available)} available × worker.cache_memory_fraction {w.cache_memory_fraction:g}"
    if torch.device(device).type == "cpu" and w.cpu_pool_max_bytes and pool > w.cpu_pool_max_bytes:
        cap, held = max(w.cpu_pool_max_bytes, floor[0]), floor[1]
        if cap > w.cpu_pool_max_bytes and pool > cap:
            how += f", capped at {size(cap)} to hold {held} (above worker.cpu_pool_max_bytes {size(w.cpu_pool_max_bytes)})"
        elif cap == w.cpu_pool_max_bytes:
            how += f", capped at worker.cpu_pool_max_bytes {size(cap)}"
        pool = min(pool, cap)
    return pool, how


@dataclass(frozen=True)
class PoolSizing:
    """The pools' size, where it came from, and what it holds."""
    pool_bytes: int
    #: ``worker.pool_bytes`` or ``memory``.
    source: str
    #: How the size was reached, for people.
    how: str
    slots: dict[str, int]
    block_size: int
    max_context: int
    #: Requests of ``max_context`` tokens the pools hold at once, and the form that limits it.
    admitted: int
    limited_by: str

    def log_fields(self, forms) -> dict[str, Any]:
        """What the ``pools_sized`` log line says: per form, blocks and the tokens they hold."""
        return {"source": self.source, "pool_bytes": self.pool_bytes, "how": self.how,
                "forms": {f.name: {"blocks": self.slots.get(f.name, 0),
                                   "tokens": self.slots.get(f.name, 0) * self.block_size} for f in forms},
                "max_context": self.max_context, "requests_at_max_context": self.admitted,
                "limited_by": self.limited_by}


def size_pools(catalogue: FormCatalogue, cfg: Config, device: Any, max_context: int,
               available: tuple[int, str] | None = None) -> PoolSizing:
    """The pools of a worker with ``cfg`` on ``device`` (see the module docstring). Raises
    :class:`PoolSizeError` when pools sized from memory cannot hold one request of
    ``max_context`` tokens; an explicit ``worker.pool_bytes`` is the operator's choice (the
    caller warns)."""
    block = cfg.cache.block_size
    if cfg.worker.pool_bytes is not None:
        pool, source, how = cfg.worker.pool_bytes, "worker.pool_bytes", f"worker.pool_bytes {cfg.worker.pool_bytes:,}"
    else:
        free, where = available or available_memory(device)
        pool, how = memory_pool_bytes(cfg, device, free, concurrency_floor(catalogue.forms, cfg, block, max_context))
        source, how = "memory", how.replace("available", where, 1)
    slots = pool_slots(catalogue, cfg, pool)
    admitted, limited_by = requests_admitted(catalogue.forms, slots, block, max_context)
    sizing = PoolSizing(pool, source, how, slots, block, max_context, admitted, limited_by)
    if admitted < 1 and source == "memory":
        f = next(f for f in catalogue.forms if f.name == limited_by)
        need = blocks_per_request(f.scope, f.window_tokens, block, max_context)
        raise PoolSizeError(
            f"the cache pools sized from memory ({how}: {size(pool)} × service.cache_reserve_ratio "
            f"{cfg.service.cache_reserve_ratio:g}) hold {slots.get(f.name, 0):,} blocks of form {f.name}; one request "
            f"of the maximum context ({max_context:,} tokens, service.max_context_length or the model's maximum) "
            f"needs {need:,} ({size(need * f.bytes_per_block)}). Free memory, raise "
            f"worker.cache_memory_fraction or worker.cpu_pool_max_bytes, lower service.max_context_length, or "
            f"set worker.pool_bytes")
    return sizing
