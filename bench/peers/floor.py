"""The decode floor: a decode step reads every weight once, so no server's inter-token latency at
c=1 goes below the model's weight bytes ÷ this machine's memory bandwidth, measured here."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import torch


def weight_bytes(model_dir: Path) -> int:
    """Bytes of every tensor in the checkpoint's safetensors files (read from their headers)."""
    total = 0
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    return total


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth(mib: int = 256, reps: int = 7) -> dict[str, float]:
    """GB/s (10^9 bytes) with every core's thread, best of ``reps``: ``copy`` (a ``mib`` MiB float32
    tensor copied: bytes read + written) and ``matvec`` (a ``mib`` MiB float32 matrix times a
    vector: the matrix's bytes, as a decode step reads its weights)."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        n = mib * 2**20 // 4
        src, dst = torch.rand(n), torch.empty(n)
        t_copy = _best(lambda: dst.copy_(src), reps)
        copy = 2 * src.numel() * 4 / t_copy / 1e9
        del src, dst
        cols = 4096
        w, x = torch.rand(n // cols, cols), torch.rand(cols)
        t_mv = _best(lambda: torch.mv(w, x), reps)
        matvec = w.numel() * 4 / t_mv / 1e9
        return {"copy": copy, "matvec": matvec}
    finally:
        torch.set_num_threads(before)


def floor_ms(model_bytes: int, gbs: float) -> float:
    return model_bytes / (gbs * 1e9) * 1e3
