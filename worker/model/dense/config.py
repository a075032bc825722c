"""Sizes of a standard full-attention decoder (Llama, Qwen2, Qwen3) and its rotary table.

The fields are those of transformers' ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` that
change what the model computes; :mod:`worker.model.checkpoint` maps a ``config.json`` onto them
and refuses what it cannot run. The per-family differences are flags, not subclasses:

* ``qkv_bias`` — biases on the q/k/v projections (Qwen2 always; Llama and Qwen3 when
  ``attention_bias``), ``o_bias`` — a bias on the output projection (Llama and Qwen3 with
  ``attention_bias``; never Qwen2), ``mlp_bias`` (Llama's ``mlp_bias``);
* ``qk_norm`` — Qwen3's per-head RMSNorm of q and k before the rotation;
* ``layer_types`` — ``full_attention`` or ``sliding_attention`` per layer; a sliding layer
  attends to the ``sliding_window`` most recent positions, itself included;
* ``vision`` and ``image_token_id`` — a vision encoder (:mod:`worker.model.vision`) whose vectors
  replace the embeddings of the prompt's image tokens (which carry ``image_token_id``); both or
  neither.

RoPE types: ``default``, ``linear``, ``llama3`` and ``yarn``, computed as transformers computes
them (``rope_inv_freq``). ``dynamic`` and ``longrope`` change the frequencies with the length
of the sequence, so a cached key would not be the key a longer request computes: refused.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from worker.model.config import ConfigError
from worker.model.vision import VisionConfig

FULL, SLIDING = "full_attention", "sliding_attention"
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One rotary table, as transformers' ``rope_parameters`` describe it."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float = 1.0
    #: llama3: wavelength thresholds over ``original_max_position_embeddings``.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    #: yarn: correction range and the cos/sin scale (``None`` = transformers' default rule).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_parameters.rope_type {self.rope_type!r} is not supported; supported: "
                              f"{', '.join(ROPE_TYPES)} (dynamic and longrope rescale with the sequence length, "
                              f"which a prefix cache cannot follow)")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_parameters.rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_type != "default" and self.factor <= 0:
            raise ConfigError(f"rope_parameters.factor must be > 0, got {self.factor}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings <= 0:
            raise ConfigError(f"rope_parameters.original_max_position_embeddings is required for "
                              f"rope_type {self.rope_type!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"rope_parameters: high_freq_factor {self.high_freq_factor} must exceed "
                              f"low_freq_factor {self.low_freq_factor}")

    def describe(self) -> str:
        """Everything that changes the table, for the form spec."""
        return ":".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim // 2]`` (float32) and the cos/sin scale, as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them for the same parameters."""
    base = spec.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if spec.rope_type == "default":
        return inv, 1.0
    if spec.rope_type == "linear":
        return inv / spec.factor, 1.0
    if spec.rope_type == "llama3":
        old = spec.original_max_position_embeddings
        low_wl, high_wl = old / spec.low_freq_factor, old / spec.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / spec.factor, inv)
        smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    factor = spec.factor
    if spec.attention_factor is not None:
        attention = spec.attention_factor
    elif spec.mscale and spec.mscale_all_dim:
        attention = _mscale(factor, spec.mscale) / _mscale(factor, spec.mscale_all_dim)
    else:
        attention = _mscale(factor)
    orig = spec.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


@dataclass(frozen=True, slots=True)
class DenseConfig:
    """Frozen sizes of one dense model. ``DenseConfig()`` is a tiny Llama-shaped default."""

    model_id: str = "kvledger/llama-tiny"
    family: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_types: tuple[str, ...] = (FULL,) * 4
    sliding_window: int = 0
    rope: RopeSpec = field(default_factory=RopeSpec)
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"family {self.family!r}: use one of {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads {self.num_key_value_heads} must divide num_attention_heads "
                              f"{self.num_attention_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even (rotary pairs)")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries; num_hidden_layers is "
                              f"{self.num_hidden_layers}: give one per layer")
        bad = sorted({t for t in self.layer_types if t not in (FULL, SLIDING)})
        if bad:
            raise ConfigError(f"layer_types: {bad} not supported; use {FULL!r} or {SLIDING!r}")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be > 0 when a layer is {SLIDING!r}, got {self.sliding_window}")
        if (self.vision is None) != (self.image_token_id is None):
            raise ConfigError("vision and image_token_id go together: a vision encoder needs the token id its "
                              "image positions carry, and an image token needs an encoder")
        if self.image_token_id is not None and not 0 <= self.image_token_id < self.vocab_size:
            raise ConfigError(f"image_token_id {self.image_token_id} is not in the vocabulary "
                              f"(0..{self.vocab_size - 1})")

    def window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees (itself included); 0 = all before it."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0

    def replace(self, **changes) -> DenseConfig:
        return dataclasses.replace(self, **changes)
