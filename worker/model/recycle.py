"""Per-request K/V buffers kept after their request ends, for the next request's state.

Why: a request's state is a pair of preallocated buffers (``worker.model.dense.state``). Fresh,
their pages are faulted in and zeroed by the kernel on first touch, and on the 2-vCPU VMs this
was measured on that touch is slow: in a SmolLM2 server at c = 32 a restore of ~630 cached
tokens took ~80 ms, ~65 % of it in the kernel zeroing pages under the copy (perf:
``clear_page_erms`` under ``direct_copy_kernel``), against ~5 ms into touched pages; the
forwards paid the same for every new row. A buffer kept here is handed to the next state of
the same shape whose capacity it covers, its pages already resident.

Why it is safe: a buffer is given back only when its state object is gone (``__del__``) and no
view of its storage is alive (the storage's use count is checked), and a state never reads a
row it did not write or restore (``worker.model.state``), so the stale rows a reused buffer
holds are never read. Capacity of CPU memory only: on a GPU the caching allocator does this.

Bounded by ``limit_bytes`` (``worker.kept_state_bytes``): past it the least recently given
buffers are dropped (freed to the system).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

#: Capacities of new buffers are rounded up to a multiple of this many positions.
GRANULE = 256


def size_class(capacity: int) -> int:
    """The capacity a new buffer for ``capacity`` positions is made with: half as long again,
    rounded up to :data:`GRANULE`, so that a kept buffer covers the next turn of the same chat
    (which carries the last one and a few hundred tokens more). A fresh buffer costs its whole
    length in faulted pages (its layers lie one after another, each touched from its start), so
    the headroom is bounded rather than rounded to the longest request seen (tried: a second
    wave of fresh buffers twice as long, restores 200 ms each, when the chats grew past 1,024)."""
    return -(-(capacity + capacity // 2) // GRANULE) * GRANULE


class BufferRecycler:
    """Kept ``(k, v)`` buffer pairs ``[layers, capacity, ...]`` of one model (see the module docstring)."""

    def __init__(self, limit_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._bytes = 0
        # NOTE: re-entrant: ``give`` runs from ``__del__``, which a garbage collection started
        # inside ``take`` on this same thread may call.
        self._lock = threading.RLock()
        self.reused = 0
        self.made = 0

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
             most: int | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A buffer pair of ``shape`` (``[layers, capacity, ...]``) or of a larger capacity: the
        smallest kept one that covers it, else new ones (capacity rounded up by :func:`size_class`,
        to at most ``most`` positions; uninitialised either way), and whether it was kept (its pages
        resident: a new one's are faulted in and zeroed by the kernel as they are first written)."""
        layers, cap, *rest = shape
        if self.limit_bytes > 0 and device.type == "cpu":
            with self._lock:
                fits = [i for i, (k, _) in enumerate(self._kept)
                        if k.dtype == dtype and k.shape[0] == layers and list(k.shape[2:]) == rest
                        and k.shape[1] >= cap]
                if fits:
                    best = min(fits, key=lambda i: self._kept[i][0].shape[1])
                    k, v = self._kept.pop(best)
                    self._bytes -= 2 * k.nbytes
                    self.reused += 1
                    return k, v, True
                cap = max(cap, min(size_class(cap), most)) if most else size_class(cap)
        self.made += 1
        full = (layers, cap, *rest)
        return torch.empty(full, dtype=dtype, device=device), torch.empty(full, dtype=dtype, device=device), False

    def give(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a dead state's buffers, unless a view of either is still alive or they exceed the bound."""
        if self.limit_bytes <= 0 or k.device.type != "cpu" or 2 * k.nbytes > self.limit_bytes:
            return
        # NOTE: the state held the only tensor of each storage; a higher count is a view that
        # outlived it (it must not see another request's rows written under it)
        if _storage_users(k) > 1 or _storage_users(v) > 1:
            return
        with self._lock:
            self._kept.append((k, v))
            self._bytes += 2 * k.nbytes
            while self._bytes > self.limit_bytes:
                old_k, _ = self._kept.pop(0)
                self._bytes -= 2 * old_k.nbytes


def _storage_users(t: torch.Tensor) -> int:
    """Tensors sharing ``t``'s storage (``t`` itself counted once)."""
    storage = t.untyped_storage()
    # NOTE: the Python storage object made here holds a reference of its own
    return torch._C._storage_Use_Count(storage._cdata) - 1
