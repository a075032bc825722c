"""Batch-invariant matrix products on the CPU path: a row's bits never depend on its company.

Why this exists: when several requests share one forward, each row must come out exactly as
it would alone (and a decode step's row exactly as the same token's row in a prefill unit),
or batching and reply-block reuse would change logits.

**The product: invariant by construction** (``kernels/cpu_linear``). Float32 and bfloat16
products on the CPU go through a small compiled kernel in which every output element
``(m, n)`` is reduced over K by one fixed instruction sequence: 16 float32 lanes start at zero,
each 16-wide chunk of K in order is multiplied into them with one FMA (the last partial chunk
loaded zero-filled, the same way), then one fixed tree sums the lanes; bfloat16 is widened
exactly, accumulated in float32 and rounded once (on a CPU with AVX512_BF16: 32-wide chunks,
one ``VDPBF16PS`` each, whose order within a chunk the instruction fixes; on a CPU with AMX,
through tiles instead, every bfloat16 product of the process: one float32 chain per element over
K's pairs in order, ``TDPBF16PS`` on the weights read in place: 4x faster at 32 rows, 7x at 512). Rows are tiled (up to 4 at a time) and
columns grouped (up to 8) only to reuse loads: every tile shape runs the same per-element code,
and the compiler may neither reassociate nor contract it (``-ffp-contract=off``, no
``-ffast-math``). Threads split the OUTPUT COLUMNS, never an element's reduction. So nothing
about an element's arithmetic depends on the row count, the tile it falls in or the thread
count: no padding, one row reads the weights once (a matrix-vector product), and the kernel
uses every core with its own small thread pool while torch keeps one intra-op thread. It is
built once per machine (g++, ninja; offline) on first import; :func:`calibrate` still probes it
at the model's shapes (rows 1..N against a larger product, alternating one thread and all of
them) before trusting it, and turns it off for good in this process if the probe fails.

**The fallback: padding to a measured floor** (no compiler, ``KVL_CPU_LINEAR=0``, float16,
or a failed probe). Measured with torch 2.13.0's CPU build (MKL; 1 and 2 intra-op threads, K
from 16 to 1024, M and N up to 513; see ``docs/BENCHMARKS.md``, Batched execution, and
``tests/model/test_batch_invariance.py``): an element of ``X @ W.T`` is the same whatever the
other rows and columns **as long as the product has at least** :data:`MIN_ROWS` **rows and**
:data:`MIN_COLS` **columns**; below that, MKL takes other code paths whose reduction order
differs. So :func:`linear` then pads a short product up to that size with zero rows (or zero
weight rows) and slices the answer. :func:`bmm_rows` (attention's grouped products) always
takes this path.

Elementwise transcendental functions (``exp``, ``sigmoid``, ``softplus``, ``silu``) have a
second trap: ATen's CPU loops run the vectorised (SLEEF) form over whole vectors and the
scalar libm form over the tail of the flattened tensor, and the two round differently. So an
element's bits depend on whether it falls in the tail, i.e. on the tensor's size.
:func:`pointwise` pads the flattened input to a multiple of :data:`VECTOR_PAD` elements so
every element takes the vector path.

The padded products and the pointwise rule hold only with ONE intra-op thread: with two, MKL
and ATen split the rows (or the flattened elements) between threads and every split point is a
new edge (measured: a 5-row product differs from the same rows in a 600-row one at 2 threads).
The worker runs torch with one (``KVL_TORCH_THREADS``, default 1; :func:`invariant_here` says
whether the current process does); the compiled product's own threads
(``KVL_LINEAR_THREADS``, default: every usable core) are not torch's.

Attention, whose reduction length grows with the history: :func:`attention` runs the compiled
kernel (``kernels/cpu_linear/cpu_attention.cpp``) in which each (query row, head) reads its own
keys in place, in position order, by one fixed instruction sequence, so nothing depends on the
other rows or requests of the call or on how a prompt is cut (~35x faster than the padded
chunked form for a 224-row prefill over 736 keys on SmolLM2's shapes). Without it, the callers'
layout does it: a fixed split of the reduction into :data:`KEY_CHUNK`-wide pieces, summed in
order (``kernels.sparse_attention.reference``, ``worker.model.dense.attention.attend``).

The padding rule is a measurement of one BLAS build on one CPU, not a law. The row floor moves
with the CPU: 4 rows on the AVX2 Xeon it was first measured on, 16 on an AVX-512/AMX Xeon
(Sapphire Rapids) with the same torch build, where products of 12–15 rows take a kernel of
their own. So :func:`calibrate` finds the floor on the machine that runs the model (the
smallest of :data:`ROW_FLOORS` for which :func:`probe` passes at the model's shapes) and sets
:data:`MIN_ROWS`; where none passes, the worker refuses to fuse requests (and to export
decode-made blocks).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from kernels import cpu_linear

#: Smallest row count whose rows are computed as in any larger product: set by :func:`calibrate`
#: for this machine (4 until then, the first machine's floor; see above).
MIN_ROWS = 4
#: The row floors :func:`calibrate` tries, smallest first (padding costs more rows per product).
ROW_FLOORS = (4, 8, 12, 16, 24, 32, 64)
#: Smallest column count whose columns are computed as in any wider product.
MIN_COLS = 12
#: Elementwise ops see inputs padded to a multiple of this many elements (2 vectors of 16 floats
#: with AVX-512, 4 of 8 with AVX2): no element lands in a scalar tail.
VECTOR_PAD = 64
#: Width of one piece of a split reduction over keys (attention, see the module docstring).
KEY_CHUNK = 16

#: Dtypes the compiled product computes (others take the padded path).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
#: The compiled product (:mod:`kernels.cpu_linear`) while it serves :func:`linear`; ``None``:
#: the padded path (not built here, or turned off by a failed probe, for good in this process).
_kernel = cpu_linear.load()
#: Why :data:`_kernel` is ``None`` ("" while it serves).
kernel_off_reason = "" if _kernel is not None else cpu_linear.why_not()


def linear_path() -> str:
    """Which arithmetic :func:`linear` runs here: ``compiled-<n>`` (:mod:`kernels.cpu_linear`,
    version ``n`` of its per-element order; ``-amx`` where bfloat16 runs through AMX tiles, other
    bits than without) or ``padded`` (MKL with a row floor)."""
    return f"compiled-{cpu_linear.ARITHMETIC}{_amx(_kernel)}" if _kernel is not None else "padded"


def _amx(module) -> str:
    """``-amx`` where the compiled module runs bfloat16 through AMX tiles (``isa()`` says so), else ""."""
    return "-amx" if module.isa().endswith(" amx") else ""


def _wide(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[N, K]`` with zero rows appended up to :data:`MIN_COLS` outputs."""
    return torch.cat([w, w.new_zeros(MIN_COLS - w.shape[0], w.shape[1])], 0)


_plain = False


@contextlib.contextmanager
def plain_ops() -> Iterator[None]:
    """Run the plain (not batch-invariant) products inside: only to measure what invariance
    costs (``bench.model``'s ``batch_invariant_slowdown``); never for serving."""
    global _plain
    before, _plain = _plain, True
    try:
        yield
    finally:
        _plain = before


@contextlib.contextmanager
def padded_products(floor: int | None = None) -> Iterator[None]:
    """Run :func:`linear` on the padded path inside (row floor ``floor``, default the current
    one): only to measure what the compiled product buys (``bench.model``); never for serving."""
    global _kernel, MIN_ROWS
    before = _kernel, MIN_ROWS
    _kernel, MIN_ROWS = None, floor or MIN_ROWS
    try:
        yield
    finally:
        _kernel, MIN_ROWS = before


def rules() -> tuple[int, bool, str]:
    """What the products' bits depend on in this process besides their inputs: the row floor,
    whether the plain ops are on and which product serves (a probe's answer is valid only under
    the same rules)."""
    return MIN_ROWS, _plain, linear_path()


def invariant_here() -> bool:
    """Whether this process runs torch with the one intra-op thread the rules above need."""
    return torch.get_num_threads() == 1


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, each element computed on the vector path (see above)."""
    n = x.numel()
    pad = (-n) % VECTOR_PAD
    if _plain or (pad == 0 and x.is_contiguous()):
        return fn(x)
    flat = torch.cat([x.reshape(-1), x.new_zeros(pad)]) if pad else x.reshape(-1)
    return fn(flat)[:n].view(x.shape)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` whose every output row is independent of the other rows of ``x``.

    ``x`` ``[..., K]``; ``w`` ``[N, K]``. Leading dims are flattened to rows.
    """
    return _linear(x, w, bias, 0)


def paths_token() -> tuple:
    """What decides which paths :func:`compiled_serves` and :func:`attention_serves` take, besides
    their operands: a caller that caches their answers keeps this beside them."""
    return _plain, id(_kernel), id(_attention)


def compiled_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` computes ``x @ w.T`` by the compiled product, whose every element is
    reduced by one code whatever ``w``'s row count: products over one input may then be fused into
    one (``worker.model.linear.Fused``) without changing a bit."""
    return (not _plain and _kernel is not None and x.dtype in KERNEL_DTYPES and w.dtype == x.dtype
            and x.device.type == "cpu" and w.device.type == "cpu")


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    """:func:`linear`; ``threads`` for the compiled product: 1 = the calling thread alone, 0 = its pool."""
    if _plain:
        return F.linear(x, w, bias)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    m, n = rows.shape[0], w.shape[0]
    if (_kernel is not None and rows.dtype in KERNEL_DTYPES and w.dtype == rows.dtype
            and rows.device.type == "cpu" and w.device.type == "cpu"):
        # NOTE: no autograd through the compiled product (inference only)
        y = _kernel.linear(rows.detach(), w.detach(), threads)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, n)
    if m < MIN_ROWS:
        rows = torch.cat([rows, rows.new_zeros(MIN_ROWS - m, rows.shape[1])], 0)
    ww = _wide(w) if n < MIN_COLS else w
    y = F.linear(rows, ww)
    if m < MIN_ROWS or n < MIN_COLS:
        y = y[:m, :n]
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, n)


#: The compiled module while it serves :func:`attention` (:mod:`kernels.cpu_linear`'s
#: ``cpu_attention.cpp``); ``None`` where it is not built or ``KVL_CPU_ATTENTION=0``: callers then
#: keep their padded, chunked attention (``worker.model.dense.attention.attend``).
_attention = cpu_linear.load() if os.environ.get("KVL_CPU_ATTENTION", "1") != "0" else None
#: The dtypes it reads (queries and K/V; the result is float32).
ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def attention_path() -> str:
    """Which arithmetic attention runs here: ``compiled-<n>`` (version ``n`` of its per-row order;
    ``-amx`` where bfloat16 scores go through AMX tiles, other bits) or ``chunked`` (the padded
    products and key pieces of the callers' own code)."""
    return f"compiled-{cpu_linear.ATTENTION_ARITHMETIC}{_amx(_attention)}" if _attention is not None else "chunked"


def attention_serves(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`attention` computes these queries and keys (else the caller's own path)."""
    return (_attention is not None and not _plain and q.device.type == "cpu" and q.dtype in ATTENTION_DTYPES
            and k.dtype in ATTENTION_DTYPES)


def attention(q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], bounds: list[int],
              positions: torch.Tensor, key_lo: list[int], window: int, scale: float) -> torch.Tensor:
    """Causal (optionally windowed) attention of ragged segments, each over its own K/V read in place.

    ``q`` ``[N, H, D]``; segment ``s`` owns rows ``bounds[s]:bounds[s + 1]`` at ``positions`` and keys
    ``kv[s]`` (``[L, kvh, D]`` each, positions ``key_lo[s]`` on). A query at ``t`` reads the keys
    ``max(0, t - window + 1) .. t`` (``window`` 0: from 0), in order, each (row, head) by one fixed
    instruction sequence (``cpu_attention.cpp``): its bits do not depend on the other segments,
    rows or keys of the call, nor on how a prompt is cut. Returns float32 ``[N, H, D]``."""
    return _attention.attention(q.detach(), [k for k, _ in kv], [v for _, v in kv], bounds, positions, key_lo,
                                window, scale)


def attention_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffers: list[tuple[torch.Tensor, torch.Tensor]],
                     layer: int, starts: list[int], bounds: list[int], positions: torch.Tensor, key_lo: list[int],
                     window: int, scale: float, prefixes: list[torch.Tensor] | None = None,
                     block_size: int = 0) -> torch.Tensor:
    """:func:`attention` for segments whose K/V live in per-request buffers ``[layers, capacity, kvh, D]``
    (``buffers[s]``, K and V): segment ``s``'s new rows ``k``/``v`` ``[bounds[s], bounds[s + 1])`` are
    written at ``layer``, positions ``starts[s]`` on, then its queries read that layer's keys from
    ``key_lo[s]`` in place. The same bytes written and the same arithmetic as a write per segment
    then :func:`attention`, in one call per layer.

    ``prefixes[s]`` (int64 ``[layers, nb, 2]``, or empty): segment ``s``'s first ``nb`` blocks of
    ``block_size`` positions are read where a cache holds them, not from its buffers — block ``b``'s
    K and V rows of layer ``l`` at the addresses ``[l, b]`` (``DenseState.prefix_table``); the same
    bits as with those rows in the buffers."""
    return _attention.attention_cached(q.detach(), k.detach(), v.detach(), [b[0] for b in buffers],
                                       [b[1] for b in buffers], layer, starts, bounds, positions, key_lo,
                                       window, scale, 0, prefixes or [], block_size)


def bmm_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(x, w)`` (``x`` ``[G, M, K]``, ``w`` ``[G, K, N]``) with rows independent of ``M``."""
    if _plain:
        return torch.bmm(x, w)
    m = x.shape[1]
    x = x.contiguous()   # NOTE: a strided operand takes another path whose order can differ
    if m < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(x.shape[0], MIN_ROWS - m, x.shape[2])], 1)
    if x.dtype == torch.float16 and x.device.type == "cpu":
        # NOTE: ATen's float16 bmm on the CPU picks its kernel by the whole batch's size, and
        # the kernels round differently: a group's bits changed with the number of groups beside
        # it (~0.3 % of random [G, 16, 16] products on the AVX-512-FP16 Xeon this was found on;
        # a fused decode step of a float16 model then differed from each request alone). In
        # float32, rounded once, every group is computed alone whatever G (float32 and bfloat16
        # products showed no such dependence).
        y = torch.bmm(x.float(), w.float()).to(torch.float16)
    else:
        y = torch.bmm(x, w)
    return y[:, :m] if m < MIN_ROWS else y


#: Row counts :func:`probe` compares: every count up to 33 (both sides of each small floor in
#: :data:`ROW_FLOORS`, and every length of a partial tile of 4, 8 or 16 rows), then both sides of
#: larger tile multiples.
PROBE_ROWS = (*range(1, 34), 47, 48, 49, 63, 64, 65, 95, 96, 97, 129, 256)


def probe_rows(max_rows: int = PROBE_ROWS[-1]) -> tuple[int, ...]:
    """:data:`PROBE_ROWS`, extended to ``max_rows`` (the most rows one forward can run: the
    stepper's token budget) so that every count is compared against a product that large.

    NOTE: a BLAS may switch blocking above some row count; a budget above 256 rows is only
    fused when the rows of a ``max_rows`` product equal those of every smaller one here."""
    if max_rows <= PROBE_ROWS[-1]:
        return PROBE_ROWS
    return (*PROBE_ROWS, *(m for m in (257, 511, 512, 513) if m < max_rows), max_rows - 1, max_rows)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers (``-0.0`` is not ``0.0`` here)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


#: ``(in, out)`` of the grouped products attention runs per request and head, checked for their
#: group count by :func:`probe`: scores over a piece of keys and the weighted sum of a piece.
ATTENTION_SHAPES = ((16, 16), (32, 16), (64, 16), (128, 16), (16, 32), (16, 64), (16, 128))


def probe(shapes: Iterable[tuple[int, int]], rows: Iterable[int] = PROBE_ROWS,
          *, seed: int = 0, dtype: torch.dtype = torch.float32,
          grouped: Iterable[tuple[int, int, int]] = (), attention: bool = True) -> list[str]:
    """Check that :func:`linear` and :func:`bmm_rows` keep a row's bits for every row count in
    ``rows``, with the current :data:`MIN_ROWS`; ``attention=False`` checks ``shapes`` alone
    (not attention's grouped products, which take the padded path whatever serves linear).

    Every row is checked, not one: the product of the first ``m`` rows of one input must equal,
    bit for bit, the first ``m`` rows of the product of all of them. A kernel that computes a
    partial tile at the end of the rows (the last ``m mod 16``, say) another way fails here even
    when the rows in whole tiles agree. ``shapes`` are ``(in_features, out_features)`` pairs of
    :func:`linear`; ``grouped`` are ``(groups, in, out)`` of :func:`bmm_rows` products against a
    ``[groups, out, in]`` weight seen transposed (``GroupedLinear``'s layout). Returns one line
    per failure (empty: invariant here). Cheap (tiny random products), so a worker runs it at
    start, in the dtype its model computes in (bfloat16 and float16 products take other kernels
    than float32).
    """
    g = torch.Generator().manual_seed(seed)
    rows = sorted(set(rows))
    kind = str(dtype).removeprefix("torch.")
    failures = []

    def diverges(lead: tuple[int, ...], k: int, product) -> tuple[int, int] | None:
        """The first row count in ``rows`` (and its first row) whose product differs from the
        same rows of the largest count's product."""
        x = torch.randn(*lead, rows[-1], k, generator=g).to(dtype)
        whole = product(x)
        for m in rows[:-1]:
            same = _bits(product(x[..., :m, :].contiguous())) == _bits(whole[..., :m, :])
            if not bool(same.all()):
                row = int((~same).reshape(-1, m, same.shape[-1]).any(0).any(-1).nonzero()[0])
                return m, row
        return None

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # the compiled product's threads must not matter either: odd row counts on the calling
        # thread alone, even ones (and the largest product) on its pool
        return _linear(x, w, None, 1 if x.shape[-2] % 2 else 0)

    for k, n in sorted(set(shapes)):
        w = torch.randn(n, k, generator=g).to(dtype)
        if (d := diverges((), k, lambda x, w=w: product(x, w))) is not None:
            failures.append(f"linear {k}->{n} {kind}: row {d[1]} of {d[0]} differs from the same row of "
                            f"{rows[-1]} ({_path_words(dtype)})")
    for groups, k, n in sorted(set(grouped)):
        w = torch.randn(groups, n, k, generator=g).to(dtype).transpose(1, 2)
        if (d := diverges((groups,), k, lambda x, w=w: bmm_rows(x, w))) is not None:
            failures.append(f"bmm {groups}x {k}->{n} {kind}: row {d[1]} of {d[0]} differs from the same row "
                            f"of {rows[-1]} (row floor {MIN_ROWS})")
    # A group's bits must not depend on how many groups share the product either (attention
    # runs one group per request and KV head): each group alone against all of them at once.
    for groups, k, n in (sorted(set(grouped)) + [(32, k, n) for k, n in ATTENTION_SHAPES]) if attention else ():
        w = torch.randn(max(groups, 2), k, n, generator=g).to(dtype)
        for m in (1, MIN_ROWS):
            x = torch.randn(w.shape[0], m, k, generator=g).to(dtype)
            whole = bmm_rows(x, w)
            apart = [j for j in range(w.shape[0]) if not bool((_bits(bmm_rows(x[j:j + 1], w[j:j + 1]))
                                                               == _bits(whole[j:j + 1])).all())]
            if apart:
                failures.append(f"bmm {w.shape[0]}x {k}->{n} {kind}, {m} rows: group {apart[0]} alone differs from "
                                f"the same group among {w.shape[0]}")
                break
    return failures


def calibrate(shapes: Iterable[tuple[int, int]], *, dtype: torch.dtype = torch.float32,
              grouped: Iterable[tuple[int, int, int]] = (), max_rows: int = PROBE_ROWS[-1]) -> list[str]:
    """Set :data:`MIN_ROWS` to the smallest floor in :data:`ROW_FLOORS` for which :func:`probe`
    passes at ``shapes`` (row counts up to ``max_rows``, :func:`probe_rows`) on this machine;
    returns the failures of the largest floor when none does (and leaves it there: the caller
    then does not fuse).

    The compiled product's rows do not depend on the floor, so it is probed once (at every row
    count, alternating one thread and all): if it fails, it is turned off for good in this
    process and the padded path is calibrated instead.

    NOTE: process-wide, like the BLAS it measures; the floor only grows (a second model in the
    process never lowers what the first one needs), and a compiled product once turned off stays
    off."""
    global MIN_ROWS, _kernel, kernel_off_reason
    shapes, grouped = sorted(set(shapes)), sorted(set(grouped))
    failures: list[str] = []
    if _kernel is not None and dtype in KERNEL_DTYPES and shapes:
        # NOTE: its own products only: a failure of attention's (padded) grouped products at this
        # floor is the floor loop's to fix below, and must not turn the compiled product off
        failures = probe(shapes, probe_rows(max_rows), dtype=dtype, attention=False)
        if failures:
            _kernel, kernel_off_reason = None, f"failed its probe: {failures[0]}"
        else:
            shapes = []         # settled: the floor below is attention's (bmm_rows) alone
    for floor in ROW_FLOORS:
        if floor < MIN_ROWS:
            continue
        MIN_ROWS = floor
        failures = probe(shapes, probe_rows(max_rows), dtype=dtype, grouped=grouped)
        if not failures:
            return []
    return failures


def _path_words(dtype: torch.dtype) -> str:
    if _kernel is not None and dtype in KERNEL_DTYPES:
        return f"compiled product, {_kernel.get_threads()} threads"
    return f"row floor {MIN_ROWS}"


#: CPU features whose presence changes which kernels MKL and ATen dispatch to (and so the bits).
_ISA_FLAGS = ("fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16")


def compute_fingerprint(device: torch.device | str = "cpu") -> str:
    """What decides the bits a product computes here, besides the model: the torch build (and
    the BLAS it bundles), the instruction set it dispatches to, the intra-op thread count; on
    CUDA the device and its capability. Two workers with different fingerprints may compute
    different bits from the same weights (measured: the row floor moved from 4 to 16 between two
    Xeons with the same torch build), and the compiled product computes other bits than the
    padded one (:func:`linear_path`), so the engine puts this in the namespace and they never
    share blocks."""
    dev = torch.device(device)
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        return (f"cuda:{torch.__version__}:{torch.version.cuda}:{torch.cuda.get_device_name(dev)}:"
                f"sm{cap[0]}{cap[1]}")
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = ",".join(x for x in _ISA_FLAGS if x in flags)
    return (f"{dev.type}:{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}:{vendor}:{isa}:"
            f"threads{torch.get_num_threads()}:linear-{linear_path()}:attention-{attention_path()}")


def _calibrate_at_import() -> None:
    """Calibrate once for shapes typical of small models, with one thread (the rule's condition),
    before any product runs: every computation of this process then uses the same floor, whether
    an engine (which re-calibrates at its model's shapes; the floor only grows) exists yet or not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calibrate([(32, 256), (64, 256), (128, 12), (256, 24), (256, 256), (512, 320), (1024, 256)],
                  grouped=[(2, 128, 64), (4, 256, 128)])
    finally:
        torch.set_num_threads(threads)


_calibrate_at_import()
