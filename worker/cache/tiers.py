"""The host and disk tiers as the engine sees them: storage plus the facts validation needs.

* **host** — :class:`worker.cache.host_tier.HostTier` (pinned memory on CUDA, byte-capped
  LRU, checksum re-verified on every read) plus the :class:`BlockMeta` of each entry. An
  entry the LRU pushes out is queued for the disk tier (:meth:`Tiers.take_spills`) and stays
  readable from that queue until the disk writer has handled it.
* **disk** — the shared offload directory (:mod:`worker.cache.offload_file`): one file per
  (tenant, namespace, block, form), written atomically, read with every header field and
  the checksum checked by :func:`worker.cache.planner.validate`. Any worker reads any
  other worker's files. A write that fails for lack of space or permission marks the tier
  down for ``retry_s``; the worker keeps serving without it.

Disk methods block (file I/O): the engine runs them in its I/O thread, one at a time, so
writes are sequential and a batch of reloads is one executor call.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.hashing import checksum
from worker.cache import offload_file as of
from worker.cache.host_tier import HostTier
from worker.cache.planner import BlockMeta, Observed

Key = tuple[str, str]  # (block_hash, form)
#: Alignment (bytes) of reloaded payloads: enough for any dtype a form stores.
ALIGN = 64


@dataclass(frozen=True, slots=True)
class DiskRead:
    """One block read from the disk tier: what validation needs, and the bytes."""

    observed: Observed
    data: torch.Tensor | None
    #: The tier could not be read at all (directory missing, I/O error): not the file's fault.
    unavailable: str = ""


def _disk_key(meta: BlockMeta) -> of.BlockKey:
    return of.BlockKey(namespace=meta.namespace, tenant=meta.tenant, block_hash=meta.block_hash,
                       form=meta.form, spec_digest=meta.spec_digest)


class Tiers:
    def __init__(self, host_bytes: int, disk_root: str | Path | None, *, retry_s: float = 5.0,
                 host_pins: Callable[[], set[Key]] | None = None) -> None:
        self.host = HostTier(host_bytes, on_evict=self._spill, pinned=host_pins) if host_bytes > 0 else None
        self._host_meta: dict[Key, BlockMeta] = {}
        self._spills: OrderedDict[Key, tuple[BlockMeta, torch.Tensor, bool]] = OrderedDict()
        self.disk_root = Path(disk_root) if disk_root else None
        self.retry_s = retry_s
        self._disk_down_until = 0.0
        self.disk_down_reason = ""

    # --- host ------------------------------------------------------------------------------

    def put_host(self, meta: BlockMeta, data: torch.Tensor) -> bool:
        """Copy one block to host memory; False if there is no host tier or it cannot hold it
        (too large, or only entries live leases pin could make room).

        LRU victims go to the spill queue (see :meth:`take_spills`).
        """
        if self.host is None or data.numel() > self.host.capacity_bytes:
            return False
        if self.host.put(meta.block_hash, meta.form, data, meta.checksum) is None:
            return False
        key = (meta.block_hash, meta.form)
        self._spills.pop(key, None)
        self._host_meta[key] = meta
        return True

    def _spill(self, key: Key, data: torch.Tensor, digest: str) -> None:
        meta = self._host_meta.pop(key, None)
        if meta is not None:
            self._spills[key] = (meta, data, True)

    def host_read(self, block_hash: str, form: str) -> tuple[Observed, torch.Tensor | None]:
        """A verified private copy of a host entry (or of one waiting in the spill queue)."""
        key = (block_hash, form)
        meta = self._host_meta.get(key)
        data = None
        if self.host is not None and meta is not None:
            item = self.host.peek(block_hash, form)
            if item is not None:
                data = item[0]
        if data is None and key in self._spills:
            meta, data, _ = self._spills[key]
        if meta is None or data is None:
            return Observed(None), None
        # NOTE: verify the private copy (what the model will read), once, always: host memory
        # is outside the pools' generation fencing, so the checksum is the only proof left.
        copy = data.clone()
        digest = checksum(memoryview(copy.numpy()))
        if digest != meta.checksum:
            self.host_drop(block_hash, form)
            return Observed(meta, damage=f"host-tier copy of block {block_hash[:12]}… form {form} fails its "
                                         f"checksum"), None
        return Observed(meta, nbytes=copy.numel(), checksum=lambda: digest), copy

    def host_drop(self, block_hash: str, form: str) -> bool:
        key = (block_hash, form)
        self._host_meta.pop(key, None)
        gone = self.host.drop(block_hash, form) if self.host is not None else False
        return gone or self._spills.pop(key, None) is not None

    def host_items(self) -> list[BlockMeta]:
        return list(self._host_meta.values())

    def host_clear(self) -> int:
        n = 0
        for block_hash, form in list(self._host_meta):
            n += self.host_drop(block_hash, form)
        self._spills.clear()
        return n

    def take_spills(self) -> list[tuple[BlockMeta, torch.Tensor, bool]]:
        """``(meta, bytes, from_host)`` waiting for the disk writer, oldest first.

        ``from_host`` is True for host-tier victims (their host replica must be evicted once
        handled), False for blocks queued by :meth:`spill_direct`. Entries stay readable
        through :meth:`host_read` until :meth:`spilled` is called.
        """
        return list(self._spills.values())

    def spill_direct(self, meta: BlockMeta, data: torch.Tensor) -> None:
        """Queue a block for the disk tier without passing through host memory."""
        self._spills[(meta.block_hash, meta.form)] = (meta, data.cpu(), False)

    def is_spilling(self, meta: BlockMeta) -> bool:
        return (meta.block_hash, meta.form) in self._spills

    def spilled(self, meta: BlockMeta) -> None:
        self._spills.pop((meta.block_hash, meta.form), None)

    @property
    def spill_depth(self) -> int:
        return len(self._spills)

    # --- disk ------------------------------------------------------------------------------

    def disk_available(self, now: float | None = None) -> bool:
        if self.disk_root is None:
            return False
        return (time.monotonic() if now is None else now) >= self._disk_down_until

    def mark_disk_down(self, reason: str, now: float | None = None) -> None:
        self._disk_down_until = (time.monotonic() if now is None else now) + self.retry_s
        self.disk_down_reason = reason

    def disk_write(self, meta: BlockMeta, data: torch.Tensor) -> str:
        """Write one block file atomically (blocking); returns its checksum. Raises OffloadUnavailable."""
        assert self.disk_root is not None
        host = data.cpu() if data.device.type != "cpu" else data
        _, digest = of.write_block(self.disk_root, _disk_key(meta), memoryview(host.contiguous().numpy()))
        self.disk_down_reason = ""
        return digest

    def disk_read(self, want: BlockMeta) -> DiskRead:
        """Read one block file (blocking) and report what it says about itself.

        ``want`` names the file (tenant, namespace, block, form; the spec digest the running
        model expects) and supplies the chain facts a file does not store (parent, span):
        the block hash binds them, and intersection checks the hash.
        """
        assert self.disk_root is not None
        path = of.path_for(self.disk_root, _disk_key(want))
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                head = os.pread(f.fileno(), 8, 0)
                # NOTE: read straight into an uninitialised tensor (one copy, no zero-fill), placed
                # so that the payload after the variable-length header starts ALIGN-aligned: the
                # model views these bytes as its dtype.
                hlen = int.from_bytes(head[4:8], "little") if len(head) == 8 else 0
                pad = (-(8 + hlen)) % ALIGN
                whole = torch.empty(pad + size + ALIGN, dtype=torch.uint8)
                skew = (-whole.data_ptr()) % ALIGN
                buf = whole[skew + pad:skew + pad + size]
                n = f.readinto(memoryview(buf.numpy())) if size else 0
            buf = buf[:n]
            raw = memoryview(buf.numpy())
        except FileNotFoundError:
            if not self.disk_root.exists():
                return DiskRead(Observed(None), None, unavailable=f"offload directory {self.disk_root} is missing")
            return DiskRead(Observed(None), None)
        except OSError as e:
            return DiskRead(Observed(None), None, unavailable=f"offload read failed: {e.strerror}")
        try:
            h, payload = of.split(raw)   # views: the payload is not copied
        except of.OffloadCorrupt as e:
            return DiskRead(Observed(want, damage=str(e)), None)
        meta = BlockMeta(namespace=h.namespace, tenant=h.tenant, block_hash=h.block_hash,
                         parent_hash=want.parent_hash, token_start=want.token_start, token_end=want.token_end,
                         form=h.form, spec_digest=h.spec_digest, checksum=h.checksum)
        if h.version != of.OFFLOAD_FILE_VERSION:
            return DiskRead(Observed(meta, damage=f"offload file format v{h.version}; this build reads "
                                                  f"v{of.OFFLOAD_FILE_VERSION}"), None)
        if len(payload) != h.length:
            return DiskRead(Observed(meta, damage=f"payload is {len(payload)} bytes, header says {h.length} "
                                                  f"(truncated file)"), None)
        data = buf[len(buf) - len(payload):]
        return DiskRead(Observed(meta, nbytes=len(payload), checksum=lambda: checksum(payload),
                                 aligned=data.data_ptr() % ALIGN == 0), data)

    def disk_remove(self, meta: BlockMeta) -> bool:
        if self.disk_root is None:
            return False
        try:
            return of.remove_block(self.disk_root, _disk_key(meta))
        except of.OffloadUnavailable:
            return False
