"""Kernel benchmark: each Triton kernel against its PyTorch reference at V4-Flash-like shapes.

    python -m bench.kernels [--reps N] [--only NAME[,NAME...]]

With CUDA, every case times the reference and the Triton kernel on the GPU
(``triton.testing.do_bench``), reports ``speedup = reference_ms / triton_ms`` and checks the
kernel's result against the reference (max abs error, or exact equality where the contract
is bit-exact / index-exact). Without CUDA it times the references on CPU only, at reduced
sizes where the full ones would take minutes on a small machine (each case reports the
shape it ran), and says ``"cuda": false``. Either way the last line printed is one JSON object.

Shapes (V4-Flash, §1.1 of the research notes): 64 heads × 512 dims, MQA K = V entries, a
CSA query attends to 128 window rows + 512 selected entries; indexer 64 heads × 128 dims,
top-512 out of ⌊ctx/4⌋ entries; compressor windows of 8 slots (CSA, 2 × 512 wide) and 128
slots (HCA, 512 wide); fp8 groups of 64 channels.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.block_copy.reference import gather_blocks_ref, scatter_blocks_ref
from kernels.compressor.reference import compress_entries_ref, save_state_ref
from kernels.indexer.reference import indexer_topk_ref
from kernels.quant.reference import quantize_fp8_ref
from kernels.sparse_attention.reference import paged_sparse_attn_ref, sparse_attn_ref


@dataclass(frozen=True)
class Case:
    name: str
    op: str                                  # public name in kernels.<package>
    package: str
    shape: dict[str, int]
    make: Callable[[torch.device], tuple]    # → positional arguments
    reference: Callable[..., Any]
    check: str                               # "close" | "exact" | "topk"
    mutated: int = 0                         # in-place op: its result is the first `mutated` args


def _attn_args(T, H, D, E, slots, K, n_blocks):
    def make(dev):
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(T, H, D, generator=g).to(dev, torch.bfloat16)
        pool = torch.randn(slots, E, D, generator=g).to(dev, torch.bfloat16)
        table = torch.randperm(slots, generator=g)[:n_blocks].to(dev, torch.int32)
        idx = torch.randint(0, n_blocks * E, (T, K), generator=g)
        idx[:, -K // 8:] = -1  # a few masked slots, as short histories have
        return q, pool, table, idx.to(dev), torch.randn(H, generator=g).to(dev), D ** -0.5
    return make


def _unpaged_attn_args(T, H, D, N, K):
    def make(dev):
        g = torch.Generator(device="cpu").manual_seed(1)
        q = torch.randn(T, H, D, generator=g).to(dev, torch.bfloat16)
        kv = torch.randn(N, D, generator=g).to(dev, torch.bfloat16)
        idx = torch.randint(-1, N, (T, K), generator=g).to(dev)
        return q, kv, idx, torch.randn(H, generator=g).to(dev), D ** -0.5
    return make


def _indexer_args(T, NH, DI, N, topk, ratio=4):
    def make(dev):
        g = torch.Generator(device="cpu").manual_seed(2)
        q = torch.randn(T, NH, DI, generator=g).to(dev, torch.bfloat16)
        k = torch.randn(N, DI, generator=g).to(dev, torch.bfloat16)
        w = (torch.randn(T, NH, generator=g) * (DI * NH) ** -0.5).to(dev)
        positions = torch.arange(N * ratio - T, N * ratio).to(dev)  # the chunk's last tokens see ~all entries
        return q, k, w, positions, ratio, topk
    return make


def _compress_args(n, S, C, half):
    def make(dev):
        g = torch.Generator(device="cpu").manual_seed(3)
        kv = torch.randn(n, S, C, generator=g).to(dev)
        score = torch.randn(n, S, C, generator=g).to(dev)
        angle = torch.rand(n, half, generator=g).to(dev)
        return kv, score, torch.ones(C, device=dev), 1e-6, torch.cos(angle), torch.sin(angle)
    return make


def _save_state_args(R, C, T):
    def make(dev):
        g = torch.Generator(device="cpu").manual_seed(4)
        state = torch.zeros(R, C, device=dev), torch.full((R, C), float("-inf"), device=dev)
        rows = torch.randn(T, C, generator=g).to(dev), torch.randn(T, C, generator=g).to(dev)
        return (*state, *rows, torch.arange(1000, 1000 + T, device=dev))
    return make


def _quant_args(N, D, group):
    def make(dev):
        return torch.randn(N, D, generator=torch.Generator(device="cpu").manual_seed(5)).to(dev, torch.bfloat16), group
    return make


def _pool_args(slots, E, D, n, with_src):
    def make(dev):
        g = torch.Generator(device="cpu").manual_seed(6)
        pool = torch.zeros(slots, E, D, dtype=torch.bfloat16, device=dev)
        ids = torch.randperm(slots, generator=g)[:n].to(dev)
        if with_src:
            return pool, ids, torch.randn(n, E, D, generator=g).to(dev, torch.bfloat16)
        return pool, ids
    return make


def cases(cuda: bool) -> list[Case]:
    """The benchmark cases; on CPU some sizes are reduced (the reference would take minutes)."""
    big = cuda
    T_pre = 256 if big else 32
    N_idx = 16384 if big else 4096          # 64K-token context at ratio 4 (16K on CPU)
    T_idx_pre = 512 if big else 16
    return [
        Case("attn_decode_csa", "paged_sparse_attn", "sparse_attention",
             dict(T=64, H=64, D=512, E=64, slots=2048, K=640),
             _attn_args(64, 64, 512, 64, 2048, 640, 1024), paged_sparse_attn_ref, "close"),
        Case("attn_prefill_csa", "paged_sparse_attn", "sparse_attention",
             dict(T=T_pre, H=64, D=512, E=64, slots=2048, K=640),
             _attn_args(T_pre, 64, 512, 64, 2048, 640, 1024), paged_sparse_attn_ref, "close"),
        Case("attn_unpaged_decode", "sparse_attn", "sparse_attention",
             dict(T=64, H=64, D=512, N=65536, K=640),
             _unpaged_attn_args(64, 64, 512, 65536, 640), sparse_attn_ref, "close"),
        Case("indexer_topk_decode", "indexer_topk", "indexer",
             dict(T=64, nH=64, dI=128, N=N_idx, topk=512),
             _indexer_args(64, 64, 128, N_idx, 512), indexer_topk_ref, "topk"),
        Case("indexer_topk_prefill", "indexer_topk", "indexer",
             dict(T=T_idx_pre, nH=64, dI=128, N=N_idx, topk=512),
             _indexer_args(T_idx_pre, 64, 128, N_idx, 512), indexer_topk_ref, "topk"),
        Case("compress_csa", "compress_entries", "compressor",
             dict(n=512, S=8, C=512, rope_half=32),
             _compress_args(512, 8, 512, 32), compress_entries_ref, "close"),
        Case("compress_hca", "compress_entries", "compressor",
             dict(n=16, S=128, C=512, rope_half=32),
             _compress_args(16, 128, 512, 32), compress_entries_ref, "close"),
        Case("compress_indexer", "compress_entries", "compressor",
             dict(n=512, S=8, C=128, rope_half=32),
             _compress_args(512, 8, 128, 32), compress_entries_ref, "close"),
        Case("save_state_csa", "save_state", "compressor",
             dict(R=8, C=1024, T=2048), _save_state_args(8, 1024, 2048), save_state_ref, "exact", mutated=2),
        Case("save_state_hca", "save_state", "compressor",
             dict(R=128, C=512, T=2048), _save_state_args(128, 512, 2048), save_state_ref, "exact", mutated=2),
        Case("quantize_fp8", "quantize_fp8", "quant",
             dict(N=8192, D=512, group=64), _quant_args(8192, 512, 64), quantize_fp8_ref, "exact"),
        Case("gather_blocks", "gather_blocks", "block_copy",
             dict(slots=1024, E=64, D=512, n=256), _pool_args(1024, 64, 512, 256, False), gather_blocks_ref, "exact"),
        Case("scatter_blocks", "scatter_blocks", "block_copy",
             dict(slots=1024, E=64, D=512, n=256), _pool_args(1024, 64, 512, 256, True), scatter_blocks_ref, "exact",
             mutated=1),
    ]


def _time_ms(fn: Callable[[], Any], cuda: bool, reps: int) -> float:
    if cuda:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=max(20, reps * 10)))
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _compare(check: str, got: tuple, want: tuple) -> dict[str, Any]:
    """Kernel result vs reference result (tuples of tensors)."""
    if check == "close":
        err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
        top = max(w.float().abs().max().item() for w in want)
        return {"max_abs_err": err, "ok": err <= 2e-2 * max(1.0, top)}
    if check == "topk":
        # Exact for equal scores; bf16 tensor-core scores can swap reference scores that
        # differ by an ulp, so report the fraction of positions that agree.
        match = min((g == w).float().mean().item() for g, w in zip(got, want))
        return {"index_match": match, "ok": match > 0.999}
    same = all(torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
               for g, w in zip(got, want))
    return {"bit_exact": same, "ok": same}


def run_case(case: Case, dev: torch.device, cuda: bool, reps: int) -> dict[str, Any]:
    args = case.make(dev)
    row: dict[str, Any] = {"case": case.name, "op": case.op, "shape": case.shape}
    row["reference_ms"] = round(_time_ms(lambda: case.reference(*args), cuda, reps), 4)
    if not cuda:
        return row
    impl = getattr(importlib.import_module(f"kernels.{case.package}.triton_impl"), case.op)
    row["triton_ms"] = round(_time_ms(lambda: impl(*args), cuda, reps), 4)
    row["speedup"] = round(row["reference_ms"] / row["triton_ms"], 2) if row["triton_ms"] > 0 else None
    if case.mutated:
        a, b = case.make(dev), case.make(dev)
        case.reference(*a)
        impl(*b)
        want, got = a[: case.mutated], b[: case.mutated]
    else:
        want, got = case.reference(*args), impl(*args)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    row |= _compare(case.check, got, want)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement on CPU (default 5)")
    parser.add_argument("--only", default="", help="comma-separated case names")
    ns = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    wanted = {n for n in ns.only.split(",") if n}
    rows = []
    for case in cases(cuda):
        if wanted and case.name not in wanted:
            continue
        row = run_case(case, dev, cuda, ns.reps)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "bench": "kernels",
        "cuda": cuda,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cases": rows,
    }
    if not cuda:
        result["note"] = "no CUDA: reference (PyTorch) timings on CPU only; Triton timings need a GPU"
    else:
        import triton
        result["triton"] = triton.__version__
        result["all_ok"] = all(r.get("ok", False) for r in rows)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
