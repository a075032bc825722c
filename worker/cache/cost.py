"""What hit validation and restore cost, per form: measured for the worker's histograms
(``kvl_worker_validation_seconds{form,layers}``, ``kvl_worker_restore_seconds{form}``).

Validation is split into two groups of its four layers (:mod:`worker.cache.planner`): ``metadata``
— presence, abi and intersection, which compare a replica's record with the lease and the request
— and ``integrity``, the checksum of its bytes (by far the larger part on real blocks). Grouping
keeps the label set small: forms × 2. Timed per replica (two clock reads and a wrapped checksum:
~0.8 µs a replica on this machine, against ~1.8 µs for validating a 4 KiB block and tens of µs
for checksumming a real model's block), observed once per request and form. A restore is timed per form as the model's state copies that
form's blocks in (:class:`FormTimer`, passed to ``CacheState.restore``); on a GPU that is the time
to issue the copies, which run asynchronously.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from worker.cache.planner import Observed

METADATA, INTEGRITY = "metadata", "integrity"
_replace = msgspec.structs.replace


class ValidationCost:
    """Seconds one request spent validating replicas, per form: in all (``add``) and in the
    checksums (``wrap``: the integrity layer's part of that)."""

    __slots__ = ("total", "integrity")

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.integrity: dict[str, float] = {}

    def wrap(self, obs: Observed, form: str) -> Observed:
        """``obs`` whose checksum, when the integrity layer reads it, is timed for ``form``."""
        check, integrity, clock = obs.checksum, self.integrity, time.perf_counter

        def checksum() -> str:
            t0 = clock()
            got = check()
            integrity[form] = integrity.get(form, 0.0) + clock() - t0
            return got

        return _replace(obs, checksum=checksum)

    def add(self, form: str, seconds: float) -> None:
        """Time spent validating one replica of ``form`` (its checksum included)."""
        self.total[form] = self.total.get(form, 0.0) + seconds

    def observe(self, histogram: Any) -> None:
        """One observation per form and layer group (integrity only where a checksum ran)."""
        for form, total in self.total.items():
            integ = self.integrity.get(form)
            histogram.labels(form=form, layers=METADATA).observe(max(0.0, total - (integ or 0.0)))
            if integ is not None:
                histogram.labels(form=form, layers=INTEGRITY).observe(integ)
        self.total.clear()
        self.integrity.clear()


class FormTimer:
    """Seconds a state's restore spent on each form's blocks (``with timer.form(name): …``)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def form(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def observe(self, histogram: Any) -> None:
        for form, s in self.seconds.items():
            histogram.labels(form=form).observe(s)
        self.seconds.clear()
