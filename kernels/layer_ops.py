"""A dense layer's small ops, each one compiled call giving exactly the bits of its torch expression.

Why: at one row a decode step is bound by dispatch, not arithmetic. SmolLM2's layer ran ~50 torch
ops from Python, ~5-20 us each on a few hundred elements: a weighted RMSNorm is ~12 ops (~20 us),
rotary ~6 (~9 us). ``kernels/cpu_linear/cpu_layer.cpp`` does each in one call (~1-2 us).

Nothing about the arithmetic changes: each function here has a ``reference_*`` twin, the torch
expression the models always ran, and the compiled op must give its bits. Elementwise steps are
correctly rounded either way; the one reduction (the norm's mean of squares) reproduces ATen's
CPU sum, whose order depends on the float vector width ATen's sum kernel uses here. :func:`probe`
finds that width (8 or 16 lanes) by comparing against the reference over many rows, sizes and both
dtypes, once per process on first use; where no width matches, or the compiled module is not
built, or ``KVL_CPU_LAYER_OPS=0``, the references serve. So a cache written by either path is
valid for the other (the arithmetic digest and the compute fingerprint do not move).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import cpu_linear
from kernels.invariant import VECTOR_PAD, pointwise

#: The dtypes the compiled ops compute (others take the references).
DTYPES = (torch.float32, torch.bfloat16)
#: Row lengths and row counts :func:`probe` compares (short rows, SmolLM2's 576 and 64, long rows
#: where ATen's sum cascades in levels).
PROBE_SIZES = (16, 48, 64, 128, 576, 960, 2048, 4096, 8192)
PROBE_ROWS = (1, 3, 17)

_ops = cpu_linear.load() if os.environ.get("KVL_CPU_LAYER_OPS", "1") != "0" else None
#: ATen's sum width here (set by :func:`probe`); ``0``: the compiled ops do not serve.
_lanes = 0
_probed = False
#: Why the compiled ops do not serve ("" while they do, or before the probe).
off_reason = "" if _ops is not None else (cpu_linear.why_not() or "KVL_CPU_LAYER_OPS=0")


def reference_cast_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``: normalise in float32, cast back, then the weight; ``rsqrt``
    through :func:`kernels.invariant.pointwise` (a row's bits independent of its company)."""
    xf = x.float()
    normed = xf * pointwise(torch.rsqrt, xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE (transformers' ``rotate_half``): ``x·cos + [−x₂, x₁]·sin``;
    ``x`` ``[N, heads, D]``, cos/sin ``[N, D]``."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, gate) * up


def _grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _serves(x: torch.Tensor, *others: torch.Tensor) -> bool:
    if not _probed:
        probe()
    return (_lanes != 0 and x.dtype in DTYPES and x.device.type == "cpu"
            and all(t.dtype == x.dtype and t.device.type == "cpu" for t in others) and not _grad(x, *others))


def cast_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`reference_cast_rms_norm`'s bits, in one call where the compiled op serves."""
    if _serves(x, weight) and x.shape[-1] % _lanes == 0 and x.numel() and weight.dim() == 1:
        return _ops.cast_rms_norm(x, weight, eps, _lanes)
    return reference_cast_rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`reference_rope`'s bits, in one call where the compiled op serves."""
    if _serves(x, cos, sin) and x.dim() == 3 and cos.dim() == 2 and x.numel():
        return _ops.rope(x, cos, sin)
    return reference_rope(x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`reference_silu_mul`'s bits, in one call where the compiled op serves (a gate of a
    whole number of :data:`~kernels.invariant.VECTOR_PAD` elements: no padding needed)."""
    if _serves(gate, up) and gate.numel() % VECTOR_PAD == 0 and gate.shape == up.shape:
        return _ops.silu_mul(gate, up)
    return reference_silu_mul(gate, up)


def path() -> str:
    """What serves the layer's small ops here, for the worker's self-check: ``compiled, <n> lanes``
    or ``reference: <why>`` (probes first if nothing has yet)."""
    if not _probed:
        probe()
    return f"compiled, {_lanes} lanes" if _lanes else f"reference: {off_reason}"


def paths_token() -> tuple:
    """What decides :func:`compiled_for`'s answer besides its operands (see ``kernels.invariant.paths_token``)."""
    return _probed, _lanes, id(_ops)


def compiled_for(x: torch.Tensor, *others: torch.Tensor):
    """The compiled module and ATen's sum width, where the compiled ops serve ``x`` and ``others``
    (CPU, one dtype, no autograd); else None — for a caller fusing several of them into one call
    (``worker.model.dense.model.DenseLayer``)."""
    return (_ops, _lanes) if _serves(x, *others) else None


@torch.inference_mode()
def probe() -> str:
    """Compare the compiled ops with their references here (seeded inputs, both dtypes, the sizes
    above) and let them serve only if every bit agrees; returns why not ("" when they serve)."""
    global _lanes, _probed, off_reason
    _probed = True
    if _ops is None:
        return off_reason
    g = torch.Generator().manual_seed(20261206)
    for lanes in (8, 16):
        if _agree(lanes, g):
            _lanes, off_reason = lanes, ""
            return ""
    _lanes, off_reason = 0, "the compiled layer ops differ from torch here (kernels.layer_ops.probe)"
    return off_reason


def _agree(lanes: int, g: torch.Generator) -> bool:
    for dtype in DTYPES:
        for n in PROBE_SIZES:
            w = (torch.randn(n, generator=g) * 0.5 + 1).to(dtype)
            for rows in PROBE_ROWS:
                for scale in (1e-3, 1.0, 30.0):
                    x = (torch.randn(rows, n, generator=g) * scale).to(dtype)
                    if not torch.equal(_ops.cast_rms_norm(x, w, 1e-5, lanes), reference_cast_rms_norm(x, w, 1e-5)):
                        return False
        for heads, d, rows in ((3, 64, 1), (9, 64, 5), (2, 128, 3)):
            wide = torch.randn(rows, 2 * heads * d, generator=g).to(dtype)
            x = wide[:, :heads * d].view(rows, heads, d)          # strided rows, as a fused product gives
            ang = torch.randint(0, 8192, (rows, 1), generator=g).float() * torch.rand(d // 2, generator=g)
            emb = torch.cat([ang, ang], -1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            if not torch.equal(_ops.rope(x, cos, sin), reference_rope(x, cos, sin)):
                return False
        gate = torch.randn(3, 2 * 192, generator=g).to(dtype)[:, :192] * 4
        up = torch.randn(3, 192, generator=g).to(dtype)
        if not torch.equal(_ops.silu_mul(gate, up), reference_silu_mul(gate, up)):
            return False
    return True
