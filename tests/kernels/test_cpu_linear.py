"""The compiled batch-invariant product (``kernels/cpu_linear``) behind ``kernels.invariant.linear``.

A row's bits must not depend on the row count, on where the row sits among others, on the
tile or remainder path it falls in, or on the number of threads; and the result must be the
product (close to ``F.linear``). Odd shapes on purpose: K not a multiple of the 16-lane vector,
N not a multiple of the 4- or 8-column tiles or of a thread's column block.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import kernels.invariant as inv
from kernels import cpu_linear

pytestmark = pytest.mark.skipif(inv._kernel is None, reason=f"compiled product unavailable: {inv.kernel_off_reason}")

#: (K, N); (64, 1000): 64-row blocks of weights with a 40-row edge (AMX: 4 and 3 tiles per call).
SHAPES = [(576, 192), (37, 13), (100, 70), (16, 5), (1536, 9), (3, 33), (64, 1000)]
DTYPES = [torch.float32, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.fixture
def two_threads():
    """The kernel's pool at 2 threads whatever this machine's core count (restored after)."""
    kernel = inv._kernel
    before = kernel.get_threads()
    kernel.set_threads(2)
    yield kernel
    kernel.set_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
def test_every_row_keeps_its_bits_for_any_row_count_position_and_thread_count(two_threads, k, n, dtype) -> None:
    kernel = two_threads
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(600, k, generator=g).to(dtype)
    whole = kernel.linear(x, w, 0)
    assert torch.equal(bits(kernel.linear(x, w, 1)), bits(whole))          # 1 thread vs 2
    for m in range(1, 71):
        for threads in (1, 0):
            assert torch.equal(bits(kernel.linear(x[:m], w, threads)), bits(whole[:m])), (m, threads)
    for i in (0, 1, 5, 299, 598, 599):                                      # a row alone, wherever it sat
        assert torch.equal(bits(kernel.linear(x[i:i + 1], w, 0)), bits(whole[i:i + 1])), i
        assert torch.equal(bits(kernel.linear(x[i - 3:i + 2] if i >= 3 else x[i:i + 5], w, 1)),
                           bits(whole[i - 3:i + 2] if i >= 3 else whole[i:i + 5])), i


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
def test_the_product_is_close_to_f_linear(k, n, dtype) -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(33, k, generator=g).to(dtype)
    want = F.linear(x.float(), w.float())             # exact inputs; float32 accumulation
    got = inv._kernel.linear(x, w, 0)
    assert got.dtype == dtype and got.shape == (33, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    else:                                             # one rounding to bfloat16 (8 bits), at the end
        torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-6 * k)
        assert (got.float() - want).abs().le(want.abs() * 2 ** -8 + 1e-6).all()


def test_linear_takes_the_compiled_product_with_leading_dims_bias_and_strides() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g)
    x = torch.randn(2, 3, 48, generator=g)[..., ::2]                       # not contiguous
    y = inv.linear(x, w, b)
    assert y.shape == (2, 3, 40) and inv.linear_path().startswith(f"compiled-{cpu_linear.ARITHMETIC}")
    assert torch.equal(y, inv._kernel.linear(x.reshape(6, 24).contiguous(), w, 0).reshape(2, 3, 40) + b)
    assert inv.linear(x[:0], w).shape == (0, 3, 40)
    assert torch.equal(inv.linear(x.to(torch.float16), w.to(torch.float16)),   # float16: the padded path
                       F.linear(torch.cat([x.reshape(6, 24), x.new_zeros(max(0, inv.MIN_ROWS - 6), 24)]).to(torch.float16),
                                w.to(torch.float16))[:6].reshape(2, 3, 40))


def test_products_from_two_threads_at_once_keep_their_bits(two_threads) -> None:
    """Lanes run forwards at once: one holds the pool, the other computes its columns alone."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1000, 200, generator=g)
    xs = [torch.randn(m, 200, generator=g) for m in (1, 7, 64, 3) * 8]
    want = [inv._kernel.linear(x, w, 1) for x in xs]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda x: inv._kernel.linear(x, w, 0), xs))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class _Skewed:
    """The real kernel, but rounding one kind of row or call up by one ulp: a defect the probe must see."""

    def __init__(self, kernel, defect) -> None:
        self.kernel, self.defect = kernel, defect

    def linear(self, x, w, threads):
        y = self.kernel.linear(x, w, threads)
        rows = self.defect(x.shape[0], threads)
        if rows:
            y[-rows:] = torch.nextafter(y[-rows:], torch.full_like(y[-rows:], float("inf")))
        return y

    def get_threads(self) -> int:
        return self.kernel.get_threads()


@pytest.mark.parametrize("defect", [lambda m, t: m % 4,                     # a remainder tile rounds otherwise
                                    lambda m, t: m if t == 1 else 0],       # the thread count matters
                         ids=["partial-tile", "threads"])
def test_a_kernel_that_is_not_invariant_fails_the_probe_and_calibration_turns_it_off(monkeypatch, defect) -> None:
    monkeypatch.setattr(inv, "_kernel", _Skewed(inv._kernel, defect))
    failures = inv.probe([(64, 32)], rows=range(1, 40))
    assert len(failures) == 1 and failures[0].startswith("linear 64->32 float32: row ")
    assert "compiled product" in failures[0]
    floor = inv.MIN_ROWS
    try:
        assert inv.calibrate([(64, 32)]) == []          # the padded path passes instead
        assert inv._kernel is None and inv.linear_path() == "padded"
        assert "failed its probe: linear 64->32" in inv.kernel_off_reason
        assert ":linear-padded:" in inv.compute_fingerprint()
    finally:
        inv.MIN_ROWS = floor
    monkeypatch.undo()
    assert inv.linear_path().startswith("compiled-") and inv.probe([(64, 32)]) == []


def _run(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=240, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_without_the_compiled_product_the_padded_path_serves_and_passes_its_probe() -> None:
    code = ("import kernels.invariant as inv, torch\n"
            "torch.set_num_threads(1)\n"                  # the padded path's condition
            "print(inv.linear_path(), inv.kernel_off_reason, inv.probe([(64, 32), (576, 192)]),"
            " inv.calibrate([(576, 192)], dtype=torch.float32))")
    assert _run(code, KVL_CPU_LINEAR="0") == "padded KVL_CPU_LINEAR=0 [] []"


def test_a_forked_child_gets_its_own_pool() -> None:
    """The parent's helper threads do not exist in a forked child: the child must not wait on them."""
    code = ("import os, torch, kernels.invariant as inv\n"
            "inv._kernel.set_threads(2)\n"
            "w, x = torch.randn(512, 64), torch.randn(3, 64)\n"
            "a = inv._kernel.linear(x, w, 0)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(0 if torch.equal(inv._kernel.linear(x, w, 0), a) else 1)\n"
            "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))")
    assert _run(code) == "0"


def test_the_build_name_hashes_the_source_the_flags_and_this_cpu(monkeypatch) -> None:
    name = cpu_linear.build_name()
    assert name.startswith("kvl_cpu_linear_") and name == cpu_linear.build_name()
    monkeypatch.setattr(cpu_linear, "CFLAGS", (*cpu_linear.CFLAGS, "-DX"))
    assert cpu_linear.build_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: "another cpu")
    assert cpu_linear.build_name() != name


def test_a_build_lock_left_by_a_killed_build_is_dropped_a_live_one_kept(tmp_path) -> None:
    """torch waits forever on a build directory's lock file; a build killed mid-way leaves one."""
    import time
    lock = tmp_path / "lock"
    lock.touch()
    cpu_linear._drop_stale_lock(lock)
    assert lock.exists()                                # a build under way
    old = time.time() - cpu_linear.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cpu_linear._drop_stale_lock(lock)
    assert not lock.exists()
    cpu_linear._drop_stale_lock(lock)                   # none: nothing to do


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_failing_its_floor_does_not_turn_the_compiled_product_off(monkeypatch, dtype) -> None:
    """Attention's grouped products take the padded path whatever serves ``linear``: when they
    fail at the current floor (bfloat16's did here at 4 rows), calibration raises the floor for
    them, and the compiled product, which passed its own probe, keeps serving. (It was turned off
    for good, so one bfloat16 model sent every later model of the process to the padded path.)"""
    bmm = torch.bmm

    def company_rounds_up(x, w):
        y = bmm(x, w)
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.shape[0] > 1 else y

    kernel, floor = inv._kernel, inv.MIN_ROWS
    monkeypatch.setattr(inv.torch, "bmm", company_rounds_up)
    try:
        failures = inv.calibrate([(64, 32)], dtype=dtype, grouped=[(4, 64, 32)], max_rows=64)
        assert failures and all(f.startswith("bmm ") for f in failures)     # attention: no floor passes
        assert inv._kernel is kernel and inv.linear_path().startswith("compiled-")
    finally:
        inv._kernel, inv.MIN_ROWS = kernel, floor


@pytest.mark.skipif(not inv.linear_path().endswith("-amx"), reason="no AMX tiles on this CPU (or not granted)")
def test_amx_bfloat16_is_its_own_arithmetic_and_kvl_cpu_amx_0_turns_it_off() -> None:
    """Where AMX serves bfloat16, its bits differ from VDPBF16PS's (one chain over K against 16
    lane sums), the products' and attention's scores', so both paths are in the fingerprint;
    ``KVL_CPU_AMX=0`` keeps the vector paths."""
    code = ("import hashlib, torch, kernels.invariant as inv\n"      # rounded to 8 bits, the two differ
            "g = torch.Generator().manual_seed(1)\n"                    # in ~1 of 6,000 elements: many
            "w, x = torch.randn(1024, 1536, generator=g).bfloat16(), torch.randn(256, 1536, generator=g).bfloat16()\n"
            "y = inv._kernel.linear(x, w, 0)\n"
            "q, k = torch.randn(200, 9, 64, generator=g).bfloat16(), torch.randn(200, 3, 64, generator=g).bfloat16()\n"
            "a = inv.attention(q, [(k, k)], [0, 200], torch.arange(200), [0], 0, 0.125)\n"
            "print(inv.linear_path(), inv._kernel.isa().split(', ')[1], hashlib.sha256(y.view(torch.int16).numpy()).hexdigest(),"
            " inv.attention_path(), hashlib.sha256(a.numpy()).hexdigest())")
    on, off = _run(code).split(), _run(code, KVL_CPU_AMX="0").split()
    assert on[0].endswith("-amx") and " ".join(on[1:3]) == "bfloat16 amx" and on[4].endswith("-amx")
    assert not off[0].endswith("-amx") and off[1:3] != on[1:3] and not off[4].endswith("-amx")
    assert off[3] != on[3] and off[5] != on[5]          # other bits: never the same cache
