"""The compiled CPU product behind :func:`kernels.invariant.linear` (``cpu_linear.cpp``).

Each output element is reduced over K in one fixed order whatever the row count, the tile it
falls in and the number of threads (the source's header says how), so a row's bits never depend
on its company and no padding is needed: one row reads the weights once, as a matrix-vector
product does, and threads split the output columns.

Built on first use with ``torch.utils.cpp_extension.load_inline`` (g++ and ninja; no network)
into torch's extensions directory, under a name that hashes the source, the flags and this
CPU's instruction set (``-march=native``: a cache copied to another kind of CPU is not reused
but rebuilt). :func:`load` returns the module, or ``None`` with :func:`why_not` saying why (no
compiler, ``KVL_CPU_LINEAR=0``, ...): :mod:`kernels.invariant` then keeps its padded MKL path.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import time
from types import ModuleType

SOURCE = pathlib.Path(__file__).with_name("cpu_linear.cpp")
#: Compiled as one unit, in this order: the product (with the vector ops and the thread pool),
#: attention (``cpu_attention.cpp``, which uses them), a layer's small ops (``cpu_layer.cpp``,
#: :mod:`kernels.layer_ops`), the Python bindings.
SOURCES = (SOURCE, SOURCE.with_name("cpu_attention.cpp"), SOURCE.with_name("cpu_layer.cpp"),
           SOURCE.with_name("bindings.cpp"))
#: NOTE: no -ffast-math (it would let the compiler reassociate the reduction), and no contraction
#: of a multiply and an add into an FMA the source did not write.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=c++17")

#: Version of the per-element arithmetic (chunk width, FMA, lane-sum tree, rounding): part of
#: :func:`kernels.invariant.compute_fingerprint`. Bump it whenever ``cpu_linear.cpp`` computes
#: other bits, so caches the old arithmetic wrote are never matched.
ARITHMETIC = 1
#: The same for :func:`attention`'s per-(row, head) arithmetic (``cpu_attention.cpp``).
ATTENTION_ARITHMETIC = 2

_module: ModuleType | None = None
_why_not = ""
_tried = False
#: Seconds the last :func:`load` took (a first build compiles; later ones import the cached build).
load_seconds = 0.0


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """The extension's name: the source, the flags and the CPU's features, hashed."""
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(_cpu_flags().encode())
    return f"kvl_cpu_linear_{h.hexdigest()[:16]}"


def default_threads() -> int:
    """``KVL_LINEAR_THREADS`` if set, else the cores this process may run on."""
    env = os.environ.get("KVL_LINEAR_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def load() -> ModuleType | None:
    """The compiled module (built once per machine and source), or ``None``; tried once per process."""
    global _module, _why_not, _tried, load_seconds
    if _tried:
        return _module
    _tried = True
    if os.environ.get("KVL_CPU_LINEAR", "1") == "0":
        _why_not = "KVL_CPU_LINEAR=0"
        return None
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline
        _drop_stale_lock(pathlib.Path(_get_build_directory(build_name(), verbose=False)) / "lock")
        mod = load_inline(name=build_name(), cpp_sources=["\n".join(src.read_text() for src in SOURCES)],
                          extra_cflags=list(CFLAGS),
                          verbose=False)
    except Exception as e:   # no compiler, no ninja, a failed build: the padded MKL path serves
        _why_not = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
        return None
    load_seconds = time.perf_counter() - t0
    mod.set_threads(default_threads())
    _module = mod
    return mod


#: A build lock older than this was left by a build that died (a first build takes ~1-2 min).
STALE_LOCK_S = 900


def _drop_stale_lock(lock: pathlib.Path) -> None:
    """Remove a build lock left by a process killed mid-build: torch waits on it forever."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:
        pass


def why_not() -> str:
    """Why :func:`load` returned ``None`` ("" when it did not, or was not called)."""
    return _why_not
