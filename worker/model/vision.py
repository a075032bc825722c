"""A small vision encoder: an image's patches → vectors in the language model's input space.

kvledger's own design, declared by a model config's ``vision`` (:class:`VisionConfig`; in a
checkpoint, ``config.json``'s ``vision`` section and weights named ``vision.*``):

1. pixels, uint8 ``[S, S, 3]`` (the bytes :mod:`shared.images` prepares) → float32 ``x / 127.5 − 1``
   (mean = std = 0.5 per channel: any other affine normalisation folds into the patch weights);
2. the ``(S / p)²`` patches of ``p × p`` pixels in row-major grid order, each flattened channel
   first (``[C, p, p]``, as a stride-``p`` ``Conv2d`` weight ``[hidden, C, p, p]`` flattens, so
   such a weight loads as ``patch_embed``'s) → ``patch_embed`` (linear ``3p² → hidden``) plus a
   learned ``position_embedding`` per patch;
3. RMSNorm (float32, as the dense family's), then the projector to the language model's width:
   ``proj_out(gelu(proj_in(x)))``.

The output, ``[patches, text hidden]`` in the model's dtype, replaces the token embeddings at the
image's positions (one image token per patch; :class:`PromptEmbeds` cuts it per forward).

Exactness: every product is :class:`worker.model.linear.Linear` (a row's bits never depend on
the other rows), GELU goes through ``kernels.invariant.pointwise``, and each image runs alone on
the model thread, always through the same shapes — so its vectors are the same bits in a cold
run, in a warm one and whatever else the worker runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.invariant import pointwise
from shared.images import ImageSpec
from worker.model.config import ConfigError
from worker.model.linear import Linear
from worker.model.norms import CastRMSNorm
from worker.model.state import Embeds


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """Sizes of the encoder. ``image_size`` must be a multiple of ``patch_size``; one image is
    ``(image_size / patch_size)²`` image tokens."""

    image_size: int = 32
    patch_size: int = 8
    #: RGB: what the intake produces (:mod:`shared.images`).
    num_channels: int = 3
    #: Width of the patch embedding (the projector maps it to the language model's hidden size).
    hidden_size: int = 48
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "hidden_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"vision.{name} must be a positive integer, got {v!r}")
        if self.image_size % self.patch_size:
            raise ConfigError(f"vision.image_size {self.image_size} must be a multiple of vision.patch_size "
                              f"{self.patch_size}")
        if self.num_channels != 3:
            raise ConfigError(f"vision.num_channels {self.num_channels}: only 3 (RGB) is supported")
        if not isinstance(self.rms_norm_eps, (int, float)) or self.rms_norm_eps <= 0:
            raise ConfigError(f"vision.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_dict(cls, doc: dict) -> VisionConfig:
        """From a ``config.json`` section; an unknown field is refused by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"vision.{unknown[0]}: not a field of the vision encoder (known: "
                              f"{', '.join(sorted(known))})")
        return cls(**doc)


class VisionEncoder(nn.Module):
    """Patch embedding + projection (see the module docstring). Parameter names, under the
    model's ``vision.``: ``patch_embed.{weight,bias}``, ``position_embedding``, ``norm.weight``,
    ``proj_in.{weight,bias}``, ``proj_out.{weight,bias}``."""

    def __init__(self, cfg: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        p, c = cfg.patch_size, cfg.num_channels
        self.patch_embed = Linear(c * p * p, cfg.hidden_size)
        self.position_embedding = nn.Parameter(torch.zeros(cfg.patches, cfg.hidden_size))
        self.norm = CastRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.proj_in = Linear(cfg.hidden_size, text_hidden)
        self.proj_out = Linear(text_hidden, text_hidden)

    def patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 ``[S, S, C]`` → float32 ``[patches, C·p·p]``, normalised (module docstring)."""
        cfg = self.cfg
        S, p, c = cfg.image_size, cfg.patch_size, cfg.num_channels
        if tuple(pixels.shape) != (S, S, c) or pixels.dtype != torch.uint8:
            raise ValueError(f"an image must be uint8 [{S}, {S}, {c}], got {pixels.dtype} {tuple(pixels.shape)}")
        g = S // p
        x = pixels.to(torch.float32) / 127.5 - 1.0
        x = x.permute(2, 0, 1).reshape(c, g, p, g, p).permute(1, 3, 0, 2, 4)
        return x.reshape(g * g, c * p * p).contiguous()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's vectors ``[patches, text hidden]`` in the parameters' dtype."""
        dtype = self.proj_out.weight.dtype
        x = self.patch_embed(self.patches(pixels).to(dtype)) + self.position_embedding
        x = self.norm(x)
        return self.proj_out(pointwise(F.gelu, self.proj_in(x)))


def image_spec(model: nn.Module) -> ImageSpec | None:
    """What the serving layer needs to feed ``model`` images (None: it takes none)."""
    enc = getattr(model, "vision", None)
    if not isinstance(enc, VisionEncoder):
        return None
    return ImageSpec(enc.cfg.image_size, enc.cfg.patch_size, model.cfg.image_token_id)


@torch.no_grad()
def encode_images(model: nn.Module, pixels: Sequence[bytes]) -> list[torch.Tensor]:
    """Each image's vectors (``[patches, hidden]``) from its ``S × S × 3`` RGB bytes
    (``shared.images.PreparedImage.pixels``), one image per call of the encoder. Runs on the
    model thread; ``ValueError`` for a model without a vision encoder or pixels of another size."""
    enc = getattr(model, "vision", None)
    if not isinstance(enc, VisionEncoder):
        raise ValueError("this model has no vision encoder: it does not accept images")
    S, device = enc.cfg.image_size, enc.proj_out.weight.device
    out = []
    for p in pixels:
        if len(p) != S * S * 3:
            raise ValueError(f"an image for this encoder is {S}×{S}×3 bytes, got {len(p)}")
        out.append(enc(torch.frombuffer(bytearray(p), dtype=torch.uint8).view(S, S, 3).to(device)))
    return out


class PromptEmbeds:
    """A prompt's input vectors that replace token embeddings: each image's encoder output at its
    positions. :meth:`piece` gives the part one forward's span needs (``forward_batch``'s embeds)."""

    def __init__(self, runs: Sequence[tuple[int, torch.Tensor]]) -> None:
        #: ``(first position, vectors [n, hidden])``, by position.
        self.runs = sorted(runs, key=lambda r: r[0])

    def piece(self, start: int, length: int) -> Embeds | None:
        """The overrides of positions ``[start, start + length)``, rows counted from ``start``."""
        end = start + length
        rows, vectors = [], []
        for first, v in self.runs:
            lo, hi = max(start, first), min(end, first + v.shape[0])
            if lo < hi:
                rows.append(torch.arange(lo - start, hi - start, device=v.device))
                vectors.append(v[lo - first:hi - first])
        if not rows:
            return None
        return Embeds(torch.cat(rows) if len(rows) > 1 else rows[0],
                      torch.cat(vectors) if len(vectors) > 1 else vectors[0])


__all__ = ["PromptEmbeds", "VisionConfig", "VisionEncoder", "encode_images", "image_spec"]
