"""How cached state is stored (``cache.dtype``): float32, bfloat16, float16, or fp8 with scales.

A form's payload (one block of it, as pools, tiers and the ledger's checksums see it) is its
logical tensor in the storage precision:

* ``float32`` / ``bfloat16`` / ``float16`` — the tensor in that dtype;
* ``float8_e4m3fn`` — a flat ``uint8`` payload: the e4m3 codes of every element, then one
  scale byte per group of ``group`` consecutive elements along the last dim (an e8m0
  exponent: the scale is a power of two, ``kernels.quant`` ``scale_format="e8m0"``). With
  groups of 32 that is 1 + 1/32 bytes per element: 0.258 of float32.

**Exactness** (a warm run equals a cold run whose own cached state went through the same
storage precision). The rule every family follows: a state keeps, from the moment a row is
written, the value its stored form will read back as — ``Storage.round(x)`` = decode(encode(x)) —
and every later read (attention, the indexer, the compressor's next window) reads that value.
A cold run and a run resumed from the cache then read identical numbers, provided that

1. ``round`` is idempotent in value: encoding a rounded row again decodes to the same row.
   bfloat16 and float16 trivially; fp8 because its scales are powers of two — scaling is
   exact, and a group whose largest code came out of rounding below the top binade gets a
   scale half as large and codes twice as large, which decode to the same values
   (``tests/kernels/test_kernel_quant.py`` holds the round trip to it);
2. the state's buffer dtype holds rounded values exactly (:meth:`Storage.buffer_dtype`:
   the compute dtype where the storage precision nests in it, float32 otherwise);
3. groups never straddle a row (a token, an entry): a row's stored bits depend on that row
   alone, whatever else a forward computes, so rounding keeps batch invariance.

``auto`` is what each family stored before ``cache.dtype`` existed (the hybrid family
float32, the dense family its compute dtype) and leaves its form specs, digests and the
namespace exactly as they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.quant import dequantize_fp8, quantize_fp8

#: ``cache.dtype`` values.
CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "float8_e4m3fn")
FP8 = "float8_e4m3fn"
#: Elements per fp8 scale (the largest power of two up to this that divides the last dim).
FP8_GROUP = 32
#: Smaller groups cost more than 1/8 byte of scale per byte of codes: refused.
FP8_MIN_GROUP = 8
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StorageError(ValueError):
    """A storage precision this form or model cannot use; the message says why."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Storage:
    """One storage precision (never ``auto``: :func:`resolve` turns that into a dtype)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in CACHE_DTYPES or self.name == "auto":
            raise StorageError(f"cache.dtype {self.name!r}: use one of {', '.join(CACHE_DTYPES)}")

    @property
    def fp8(self) -> bool:
        return self.name == FP8

    def group(self, form: str, *widths: int) -> int:
        """Elements per scale for a form whose rows are written ``widths`` columns at a time (the
        last dim, or its parts written separately): a power of two ≤ 32 dividing every width,
        so a group never straddles what one write covers. 0 when not fp8."""
        if not self.fp8:
            return 0
        g = math.gcd(FP8_GROUP, *widths)
        if g < FP8_MIN_GROUP:
            raise StorageError(f"cache.dtype {FP8}: form {form!r} is written {list(widths)} columns at a time, "
                               f"which allows scale groups of {g} elements; at least {FP8_MIN_GROUP} are needed "
                               f"(use bfloat16 for this model)")
        return g

    # --- layout -------------------------------------------------------------------------------

    def payload(self, shape: tuple[int, ...], group: int = 0
                ) -> tuple[tuple[int, ...], torch.dtype, int, dict[str, int | str]]:
        """``(stored shape, stored dtype, bytes, spec params)`` of one block of a form of logical
        ``shape`` (``group``: elements per fp8 scale, see :meth:`group`)."""
        n = math.prod(shape)
        if self.fp8:
            nbytes = n + n // group
            return (nbytes,), torch.uint8, nbytes, {"scale": "e8m0", "group": group}
        dt = _TORCH[self.name]
        return shape, dt, n * torch.empty((), dtype=dt).element_size(), {}

    def exact_in(self, dtype: torch.dtype) -> bool:
        """Whether every value this precision stores is exactly a ``dtype`` value."""
        name = dtype_name(dtype)
        return (name == self.name or name == "float32"
                or (self.name == "float32" and name in ("bfloat16", "float16"))   # nothing is rounded then
                or (self.fp8 and name == "bfloat16"))     # ≤ 4 significant bits times a power of two

    def buffer_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype a request state keeps rows in: ``compute`` when it holds stored values exactly."""
        return compute if self.exact_in(compute) else torch.float32

    def lossless_for(self, dtype: torch.dtype) -> bool:
        """True when storing a ``dtype`` tensor loses nothing (rounding is the identity)."""
        name = dtype_name(dtype)
        return name == self.name or (self.name == "float32" and name in ("bfloat16", "float16"))

    # --- values ------------------------------------------------------------------------------

    def round(self, x: torch.Tensor, group: int = 0) -> torch.Tensor:
        """``x`` as its stored form reads back, in ``x``'s dtype (see the module docstring);
        fp8 groups are ``group`` consecutive elements of the last dim."""
        if self.lossless_for(x.dtype):
            return x
        if self.fp8:
            q, s = quantize_fp8(x.reshape(-1, group), group, scale_format="e8m0")
            return dequantize_fp8(q, s, group).to(x.dtype).reshape(x.shape)
        return x.to(_TORCH[self.name]).to(x.dtype)

    def encode(self, x: torch.Tensor, group: int = 0) -> torch.Tensor:
        """One block's payload from its logical tensor (rows already rounded: encoding is exact)."""
        if not self.fp8:
            return x.to(_TORCH[self.name]).contiguous()
        q, s = quantize_fp8(x.reshape(-1, group), group, scale_format="e8m0")
        return torch.cat([q.view(torch.uint8).reshape(-1), s.reshape(-1)])

    def decode(self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
               group: int = 0) -> torch.Tensor:
        """The logical tensor ``shape`` in ``dtype`` from a payload :meth:`encode` made."""
        if not self.fp8:
            return payload.reshape(shape).to(dtype)
        n = math.prod(shape)
        flat = payload.reshape(-1)
        q = flat[:n].view(torch.float8_e4m3fn).reshape(-1, group)
        s = flat[n:].reshape(-1, 1)
        return dequantize_fp8(q, s, group).reshape(shape).to(dtype)


def stored_precisions(model, block_size: int) -> dict[str, str]:
    """``{spec_digest: storage dtype}`` of ``model``'s forms at every ``cache.dtype`` it can use."""
    out: dict[str, str] = {}
    for name in CACHE_DTYPES[1:]:
        try:
            layouts = model.form_layouts(block_size, name)
        except StorageError:
            continue
        out.update({lay.spec.spec_digest: name for lay in layouts.values()})
    return out


def resolve(cache_dtype: str, auto: torch.dtype) -> Storage:
    """The storage a family uses for ``cache.dtype`` (``auto``: the family's own ``auto`` dtype)."""
    if cache_dtype not in CACHE_DTYPES:
        raise StorageError(f"cache.dtype {cache_dtype!r}: use one of {', '.join(CACHE_DTYPES)}")
    return Storage(dtype_name(auto) if cache_dtype == "auto" else cache_dtype)
