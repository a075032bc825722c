"""Failpoints: faults a test switches on inside a real worker process.

``KVL_FAILPOINTS`` names them, comma-separated; it is read once, when the first site asks
(an engine's start). A production worker has none set, and each site asks once, at its
construction. A name this build does not know stops the worker at start with a configuration
error (:class:`FailpointError`): a typo must not make a drill silently test nothing. An active
failpoint is logged at start (``failpoints`` in the ``self_check`` line) and shown in
``/readyz`` (``batching.failpoint``), so nobody mistakes such a process for a healthy one.

Why they exist: some faults cannot be caused from outside a process. A kernel whose bits
depend on the batch is one; the run-time batch-invariance check (``service.fused_check_every``)
and what follows it (a new epoch that disowns what the worker computed) are tested on real
processes only through ``fused_skew``.
"""

from __future__ import annotations

import functools
import os

from shared.config import ConfigError

#: Every failpoint this build has, and what it does.
KNOWN: dict[str, str] = {
    "fused_skew": "every fused forward (more than one request) returns its logits scaled by 1 + 2**-12, "
                  "as a kernel whose result depends on the batch would",
}


class FailpointError(ConfigError):
    """``KVL_FAILPOINTS`` names a failpoint this build does not have."""


def parse(value: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(names - KNOWN.keys())
    if unknown:
        raise FailpointError(f"KVL_FAILPOINTS names {unknown}, which this build does not have; known: {sorted(KNOWN)}")
    return names


@functools.cache
def active() -> frozenset[str]:
    """The failpoints switched on in this process (``KVL_FAILPOINTS``)."""
    return parse(os.environ.get("KVL_FAILPOINTS", ""))


def on(name: str) -> bool:
    """Whether failpoint ``name`` (one of :data:`KNOWN`) is switched on in this process."""
    assert name in KNOWN, name
    return name in active()


__all__ = ["KNOWN", "FailpointError", "active", "on", "parse"]
