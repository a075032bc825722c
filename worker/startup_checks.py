"""Does the configured cache fit this machine? Checked once at the worker's start (issue 55).

* **The pools** are allocated once, at start, on the device. More than the device's free memory
  (CUDA: ``torch.cuda.mem_get_info``; CPU: available RAM, ``psutil``) is refused with the key to
  change (:class:`PoolMemoryError`): on a GPU the allocation fails later with a bare CUDA error,
  on a CPU the zeroed pages are only committed as the pools fill, so the machine would swap or
  the OOM killer pick a process long after the start that should have said no.
* **The host tier** (``cache.host_tier_bytes``) lives in RAM too, but fills only as blocks are
  offloaded: with the pools (on a CPU) it may exceed the RAM available and still run for a while,
  so that is a warning (``host_tier_exceeds_memory``) naming the key.

The disk tier's room is checked where its bound is resolved (:mod:`worker.cache.retention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.settings import PoolSizeError, size


class PoolMemoryError(PoolSizeError):
    """The pools are larger than the device's free memory."""


@dataclass(frozen=True, slots=True)
class Memory:
    """What is free at the check: on the pools' device and in RAM (the same on a CPU)."""
    device: str
    device_free: int
    ram_available: int

    @property
    def on_cpu(self) -> bool:
        return not self.device.startswith("cuda")


def measure(device: Any) -> Memory:
    """Free memory of ``device`` now (the weights are loaded) and the RAM available."""
    import psutil
    import torch

    dev = torch.device(device)
    ram = int(psutil.virtual_memory().available)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return Memory(str(dev), int(free), ram)
    return Memory(str(dev), ram, ram)


def check_memory(pool_bytes: int, how: str, host_tier_bytes: int, mem: Memory) -> list[str]:
    """Raise :class:`PoolMemoryError` when the pools cannot fit; the warnings (host tier) else.
    ``how``: what sized the pools (``PoolSizing.how``)."""
    where = "available RAM" if mem.on_cpu else f"free memory on {mem.device}"
    if pool_bytes > mem.device_free:
        raise PoolMemoryError(
            f"the cache pools ({size(pool_bytes)}: {how}) are larger than the {where} ({size(mem.device_free)}); "
            f"set worker.pool_bytes to at most {mem.device_free:,} (or free memory, or run fewer workers here)")
    ram_used = pool_bytes if mem.on_cpu else 0
    if host_tier_bytes and ram_used + host_tier_bytes > mem.ram_available:
        return [f"cache.host_tier_bytes {host_tier_bytes:,}" + (f" with the pools ({size(pool_bytes)})" if ram_used else "")
                + f" is more than the available RAM ({size(mem.ram_available)}): the host tier fills as blocks are "
                f"offloaded and the machine will swap before it is full; lower cache.host_tier_bytes to at most "
                f"{max(0, mem.ram_available - ram_used):,}"]
    return []
