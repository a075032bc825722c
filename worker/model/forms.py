"""The model's cache forms: what one block of cached state holds, byte for byte.

A block of ``block_size`` tokens leaves one fixed-shape float32 tensor per form:

``compressed`` (full history)
    the compressed entries emitted inside the block, ``[rows, head_dim]``: for each CSA/HCA
    layer in layer order, ``block_size / ratio`` entries (its ratio divides the block size,
    so every window that closes in the block lies wholly in it).
``indexer`` (full history; only when there are CSA layers)
    the CSA indexer keys emitted inside the block, ``[rows, index_head_dim]``, same order.
``tail`` (resume point; only when there are CSA layers)
    the compressor state at the block's *end* boundary. Because every ratio divides the
    block size, no window is open at a boundary: HCA compressors and the CSA "current
    window" are empty there, and what a resume needs is exactly the CSA overlap halo — the
    a-halves ``(c^a_j, z^a_j + B^a[j mod m])`` of the last closed window, for the main and the
    indexer compressor. Shape ``[n_csa, 2 (kv, score), ratio, head_dim + index_head_dim]``:
    the main halo in the first ``head_dim`` columns, the indexer halo after it.
``swa`` (window of ``sliding_window - 1`` tokens)
    every layer's raw K=V rows (after ``kv_norm`` and RoPE) of the block's tokens,
    ``[layers, block_size, head_dim]``. A query attends to itself and the ``W - 1`` rows
    before it, so a resume at ``p`` needs the rows of ``[p - W + 1, p)``.

``params`` carry ratios, widths, layers and the rotary description, so a change to any of
them changes ``spec_digest`` and stored state is rejected instead of misread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.forms import FormCatalogue, FormScope, FormSpec
from worker.model.config import ModelConfig, check_block_size
from worker.model.storage import Storage, resolve

#: Byte layout version of every form defined here; bump with any layout change.
LAYOUT_VERSION = 1
#: The dtype this family's request states keep rows in and, with ``cache.dtype: auto``, store
#: them in, whatever dtype the model computes in: a bfloat16 or float16 model's rows are stored
#: exactly in float32, and its compressor and attention accumulate in float32. Other
#: ``cache.dtype`` values store bfloat16, float16 or fp8 (``worker.model.storage``).
STATE_DTYPE = torch.float32

COMPRESSED, INDEXER, TAIL, SWA = "compressed", "indexer", "tail", "swa"


@dataclass(frozen=True, slots=True)
class FormLayout:
    """A declared form plus the tensor shape and dtype of one block's payload.

    ``shape``/``dtype`` are the payload's (what a pool slot's bytes are viewed as); ``logical``
    is the tensor a state exports and restores, which the payload encodes in the ``storage``
    precision (``worker.model.storage``: the same tensor, or fp8 codes and scales).
    """

    spec: FormSpec
    shape: tuple[int, ...]
    dtype: torch.dtype
    logical: tuple[int, ...] = ()
    storage: Storage | None = None
    #: Elements per fp8 scale (0: not fp8).
    group: int = 0

    @classmethod
    def of(cls, name: str, scope: FormScope, logical: tuple[int, ...], storage: Storage, params: dict, *,
           layout_version: int, window_tokens: int = 0, group: int = 0) -> FormLayout:
        """The layout of a form of ``logical`` shape stored in ``storage`` (``params`` enter its spec)."""
        shape, dtype, nbytes, extra = storage.payload(logical, group)
        spec = FormSpec(name=name, scope=scope, bytes_per_block=nbytes, dtype=storage.name,
                        layout_version=layout_version, window_tokens=window_tokens, params={**params, **extra})
        return cls(spec=spec, shape=shape, dtype=dtype, logical=logical, storage=storage, group=group)

    @property
    def lossy(self) -> bool:
        """Whether rows must be rounded to the storage precision as they are written (float32 rows)."""
        return self.storage is not None and not self.storage.lossless_for(torch.float32)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as this form stores it (the value every later read must see)."""
        return x if self.storage is None else self.storage.round(x, self.group)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of one block from its logical tensor."""
        return x if self.storage is None else self.storage.encode(x, self.group)

    def decode(self, payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The logical tensor of one block, in ``dtype``."""
        if self.storage is None:
            return payload.to(dtype)
        return self.storage.decode(payload, self.logical or self.shape, dtype, self.group)



def _csv(xs) -> str:
    return ",".join(str(x) for x in xs)


def _rope_desc(cfg: ModelConfig) -> str:
    y = cfg.compress_rope_scaling
    yarn = "none" if y is None else f"yarn:{y.factor}/{y.original_max_position_embeddings}/{y.beta_fast}/{y.beta_slow}"
    return f"interleaved:{cfg.qk_rope_head_dim}:main={cfg.rope_theta}:compress={cfg.compress_rope_theta}:{yarn}"


def form_layouts(cfg: ModelConfig, block_size: int, cache_dtype: str = "auto") -> dict[str, FormLayout]:
    """Every form this model keeps at ``block_size``, with its payload shape; in catalogue order.

    ``cache_dtype`` (``cache.dtype``): the storage precision; ``auto`` is float32 (``STATE_DTYPE``)."""
    check_block_size(cfg, block_size)
    storage = resolve(cache_dtype, STATE_DTYPE)
    out: dict[str, FormLayout] = {}

    def add(name: str, scope: FormScope, shape: tuple[int, ...], params: dict, window_tokens: int = 0,
            widths: tuple[int, ...] = ()) -> None:
        out[name] = FormLayout.of(name, scope, shape, storage, {"block_size": block_size, "shape": _csv(shape), **params},
                                  layout_version=LAYOUT_VERSION, window_tokens=window_tokens,
                                  group=storage.group(name, *(widths or shape[-1:])))

    comp = cfg.compressed_layers
    if comp:
        rows = sum(block_size // cfg.compress_ratios[i] for i in comp)
        add(COMPRESSED, FormScope.FULL_HISTORY, (rows, cfg.head_dim),
            {"layers": _csv(comp), "ratios": _csv(cfg.compress_ratios[i] for i in comp),
             "csa_ratio": cfg.csa_ratio, "width": cfg.head_dim, "rope": _rope_desc(cfg)})
    csa = cfg.csa_layers
    if csa:
        m = cfg.csa_ratio
        add(INDEXER, FormScope.FULL_HISTORY, (len(csa) * (block_size // m), cfg.index_head_dim),
            {"layers": _csv(csa), "ratio": m, "width": cfg.index_head_dim, "rope": _rope_desc(cfg)})
        # the main and the indexer halves of a halo are written separately: no group may straddle them
        add(TAIL, FormScope.RESUME_POINT, (len(csa), 2, m, cfg.head_dim + cfg.index_head_dim),
            {"layers": _csv(csa), "ratio": m, "content": "csa_overlap_halo", "main_width": cfg.head_dim,
             "indexer_width": cfg.index_head_dim}, widths=(cfg.head_dim, cfg.index_head_dim))
    add(SWA, FormScope.WINDOW, (cfg.num_hidden_layers, block_size, cfg.head_dim),
        {"layers": cfg.num_hidden_layers, "sliding_window": cfg.sliding_window, "width": cfg.head_dim,
         "ratios": _csv(cfg.compress_ratios), "rope": _rope_desc(cfg)},
        window_tokens=swa_window_tokens(cfg))
    return out


def swa_window_tokens(cfg: ModelConfig) -> int:
    """Past rows a resume needs: the window includes the query itself, so ``W - 1``."""
    return max(cfg.sliding_window - 1, 1)


def declare_forms(cfg: ModelConfig, block_size: int, cache_dtype: str = "auto") -> FormCatalogue:
    """The catalogue this model declares to the coordinator (see module docstring)."""
    layouts = form_layouts(cfg, block_size, cache_dtype)
    return FormCatalogue(model_id=cfg.model_id, block_size=block_size,
                         forms=tuple(layout.spec for layout in layouts.values()))


def describe_mismatch(expected: FormSpec, got: FormSpec) -> str:
    """Human-readable list of what differs between two specs of the same form."""
    diffs = []
    for field in ("scope", "dtype", "layout_version", "bytes_per_block", "window_tokens"):
        a, b = getattr(got, field), getattr(expected, field)
        if a != b:
            diffs.append(f"{field} {a} (stored) != {b} (expected)")
    keys = sorted(set(got.params) | set(expected.params))
    for k in keys:
        a, b = got.params.get(k), expected.params.get(k)
        if a != b:
            diffs.append(f"{k} {a} (stored) != {b} (expected)")
    return "; ".join(diffs) or "specs differ"
