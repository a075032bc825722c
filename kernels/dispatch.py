"""Chooses, per call, between a Triton kernel and its PyTorch reference.

Rules, in order: a backend forced by :func:`force_backend` (tests use it to run Triton
under ``TRITON_INTERPRET=1`` on CPU tensors); the ``KVL_KERNEL_BACKEND`` environment
variable (``reference`` | ``triton`` | ``auto``); otherwise ``auto``: Triton for CUDA
tensors, the reference for everything else.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Literal

import torch

Backend = Literal["reference", "triton"]
_forced: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("kvl_backend", default=None)


class KernelUnavailable(RuntimeError):
    """Triton was asked for but cannot run here (not installed, no GPU, no interpreter)."""


@contextlib.contextmanager
def force_backend(backend: Backend) -> Iterator[None]:
    token = _forced.set(backend)
    try:
        yield
    finally:
        _forced.reset(token)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def backend_for(t: torch.Tensor) -> Backend:
    forced = _forced.get()
    if forced is not None:
        return forced
    env = os.environ.get("KVL_KERNEL_BACKEND", "auto")
    if env not in ("auto", "reference", "triton"):
        raise ValueError(f"KVL_KERNEL_BACKEND={env!r}: allowed are auto, reference, triton")
    if env != "auto":
        return env  # type: ignore[return-value]
    return "triton" if t.is_cuda else "reference"
