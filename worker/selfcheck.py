"""The worker's start-up self-check: one report of what it found, before it serves.

* **offload directory** — when ``cache.offload_dir`` is set: a probe file is written (fsynced),
  read back, compared and deleted. A directory that fails any step marks the disk tier down
  with the reason at once (the worker serves without it, as when a write fails later; the
  tier's retry applies), instead of reporting "up" until the first spill fails.
* **pools** — allocated, and their slots per form (a cache-enabled worker without them is not
  ready).
* **weights** — the namespace (model id, weights or checkpoint digest, dtype, the machine's
  compute fingerprint and the digest of what the model computes here,
  ``CausalLM.arithmetic_digest``): what every replica this worker writes is keyed by.
* **batch invariance** — whether requests share forwards here (``kernels.invariant``), and
  the row floor calibrated on this machine.
* **layer ops** — whether the layer's small ops run compiled (``kernels.layer_ops``: the same
  bits either way, only the speed differs) and why not where they do not.

:func:`check_offload_dir` is a pure function of the directory (tests call it directly); the
engine runs :func:`self_check` once at start, logs it as one ``self_check`` line and keeps it
for ``/readyz``.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from worker.cache.tiers import Tiers
    from worker.stepper import Stepper

#: Bytes of the probe file: enough to cross a page, small enough to cost nothing.
PROBE_BYTES = 8192


@dataclass(frozen=True, slots=True)
class SelfCheck:
    #: "off" (no offload directory), "ok", or "failed: <what went wrong>"
    offload: str
    pools_allocated: bool
    pool_slots: dict[str, int] = field(default_factory=dict)
    namespace: str = ""
    batch_invariant: bool = False
    row_floor: int = 0
    #: What decides the bits besides the model (``kernels.invariant.compute_fingerprint``).
    compute: str = ""
    #: ``CausalLM.arithmetic_digest`` of this model here; "" when two identical runs differed
    #: (the namespace is then this process's own).
    arithmetic: str = ""
    #: ``kernels.layer_ops.path()``: ``compiled, <n> lanes`` or ``reference: <why>``.
    layer_ops: str = ""

    @property
    def ok(self) -> bool:
        """Everything required is there (the offload directory is optional: it only degrades)."""
        return self.pools_allocated

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_offload_dir(root: Path, name: str) -> str:
    """Write, fsync, read back, compare and delete a probe file under ``root`` (created 0700 if
    missing): ``""`` when all of it works, else what failed (errno name and message)."""
    probe = root / f".kvl-probe-{name}-{os.getpid()}-{secrets.token_hex(4)}"
    data = secrets.token_bytes(PROBE_BYTES)
    step = "create the directory"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        step = "write a probe file"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            step = "fsync the probe file"
            os.fsync(fd)
        finally:
            os.close(fd)
        step = "read the probe file back"
        if probe.read_bytes() != data:
            return "the probe file read back differs from what was written"
        step = "delete the probe file"
        probe.unlink()
    except OSError as e:
        import errno

        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        return f"cannot {step} in {root} ({code}: {e.strerror})"
    return ""


class Checked(Protocol):
    """What the self-check reads of a worker (``worker.engine.Engine`` has it)."""

    tiers: Tiers
    store: object
    stepper: Stepper
    worker_id: str
    cache_enabled: bool
    slots: dict[str, int]
    namespace: str
    fingerprint: str
    arithmetic: str


def self_check(engine: Checked) -> SelfCheck:
    """Run every check once (blocking: file I/O); marks the disk tier down when its probe fails."""
    import kernels.invariant as inv
    import kernels.layer_ops as layer_ops

    offload = "off"
    root = engine.tiers.disk_root
    if root is not None:
        failure = check_offload_dir(root, engine.worker_id)
        offload = f"failed: {failure}" if failure else "ok"
        if failure:
            engine.tiers.mark_disk_down(failure)
    return SelfCheck(offload=offload, pools_allocated=engine.store is not None or not engine.cache_enabled,
                     pool_slots=dict(engine.slots), namespace=engine.namespace,
                     batch_invariant=engine.stepper.fused, row_floor=inv.MIN_ROWS, compute=engine.fingerprint,
                     arithmetic=engine.arithmetic, layer_ops=layer_ops.path())


__all__ = ["PROBE_BYTES", "Checked", "SelfCheck", "check_offload_dir", "self_check"]
