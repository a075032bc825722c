"""Backend choice: CPU → reference, forced → Triton, KVL_KERNEL_BACKEND, and clear refusals."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels import dispatch
from kernels.dispatch import KernelUnavailable, backend_for, force_backend

# (op package, public name, reference name)
OPS = [
    ("sparse_attention", "paged_sparse_attn", "paged_sparse_attn_ref"),
    ("sparse_attention", "sparse_attn", "sparse_attn_ref"),
    ("compressor", "compress_entries", "compress_entries_ref"),
    ("compressor", "save_state", "save_state_ref"),
    ("indexer", "indexer_topk", "indexer_topk_ref"),
    ("indexer", "indexer_scores", "indexer_scores_ref"),
    ("quant", "quantize_fp8", "quantize_fp8_ref"),
    ("quant", "dequantize_fp8", "dequantize_fp8_ref"),
    ("block_copy", "gather_blocks", "gather_blocks_ref"),
    ("block_copy", "scatter_blocks", "scatter_blocks_ref"),
]


def _spy(monkeypatch: pytest.MonkeyPatch, op: str, public: str, ref: str) -> list[str]:
    """Replace the op's reference and Triton functions with recorders; return the call log."""
    calls: list[str] = []
    reference = importlib.import_module(f"kernels.{op}.reference")
    triton_impl = importlib.import_module(f"kernels.{op}.triton_impl")
    monkeypatch.setattr(reference, ref, lambda *a, **k: calls.append("reference"))
    monkeypatch.setattr(triton_impl, public, lambda *a, **k: calls.append("triton"))
    return calls


def _call(op: str, public: str) -> None:
    getattr(importlib.import_module(f"kernels.{op}"), public)(torch.zeros(1), "other args are not looked at")


@pytest.mark.parametrize(("op", "public", "ref"), OPS, ids=[p for _, p, _ in OPS])
def test_cpu_tensors_use_the_reference(monkeypatch, op, public, ref):
    calls = _spy(monkeypatch, op, public, ref)
    _call(op, public)
    assert calls == ["reference"]


@pytest.mark.parametrize(("op", "public", "ref"), OPS, ids=[p for _, p, _ in OPS])
def test_forced_triton_uses_the_kernel(monkeypatch, op, public, ref):
    calls = _spy(monkeypatch, op, public, ref)
    with force_backend("triton"):
        _call(op, public)
    _call(op, public)  # the force ends with its block
    assert calls == ["triton", "reference"]


def test_environment_variable_chooses_the_backend(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.setenv("KVL_KERNEL_BACKEND", "triton")
    assert backend_for(t) == "triton"
    monkeypatch.setenv("KVL_KERNEL_BACKEND", "reference")
    assert backend_for(t) == "reference"
    monkeypatch.setenv("KVL_KERNEL_BACKEND", "auto")
    assert backend_for(t) == "reference"
    with force_backend("triton"):  # a forced backend wins over the variable
        assert backend_for(t) == "triton"


def test_bad_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KVL_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"KVL_KERNEL_BACKEND='cuda'.*auto, reference, triton"):
        backend_for(torch.zeros(1))
    from kernels.quant import quantize_fp8
    with pytest.raises(ValueError, match="KVL_KERNEL_BACKEND"):
        quantize_fp8(torch.zeros(1, 4), 4)


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dispatch.triton_interpreting()
    from kernels.quant import quantize_fp8
    with force_backend("triton"), pytest.raises(KernelUnavailable, match="x is on cpu.*TRITON_INTERPRET=1"):
        quantize_fp8(torch.zeros(2, 4), 4)
