"""Kernel tests: every Triton kernel against its PyTorch reference.

On a machine without CUDA the kernels run on CPU tensors through Triton's interpreter.
``TRITON_INTERPRET`` must be set before ``triton.jit`` decorates a kernel (at the first
import of a ``kernels/<op>/triton_impl.py``), so it is set when this file is imported.

NOTE: it is a process-wide variable, and pytest imports every directory's conftest during
collection, before any test runs. So once collection is over the previous value is put
back, and an autouse fixture sets it again only around the tests of this directory: tests
elsewhere, and the processes they start, never see it. (Other tests never import a
``triton_impl``, so the interpreted kernel objects stay private to these tests.)

With CUDA the interpreter is left off and the same tests run the compiled kernels on the
GPU (the ``device`` fixture); the few tests about CPU-only behaviour are then skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
_VAR = "TRITON_INTERPRET"
_previous = os.environ.get(_VAR)
if not CUDA:
    os.environ[_VAR] = "1"


def _restore() -> None:
    if _previous is None:
        os.environ.pop(_VAR, None)
    else:
        os.environ[_VAR] = _previous


def pytest_collection_finish(session: pytest.Session) -> None:
    _restore()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:
        monkeypatch.setenv(_VAR, "1")
    monkeypatch.delenv("KVL_KERNEL_BACKEND", raising=False)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if CUDA else "cpu")
