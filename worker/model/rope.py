"""Rotary tables: the "main" table (sliding-only layers) and the "compress" table (CSA/HCA).

Only the inverse frequencies differ between the two: the main table uses ``rope_theta``;
the compress table uses ``compress_rope_theta`` with YaRN interpolation between the
``beta_fast`` and ``beta_slow`` correction dims (and, as in DeepSeek-V4, no logit mscale).
A CSA/HCA layer uses the compress table for *all* of its rotations: queries, window keys,
compressed entries, indexer queries and keys.

cos/sin are computed as ``cos(float(pos) * inv_freq)``: one multiply and one cos per
element, so a table row is the same bits whether it is built for one position or many.
The rotation itself is :func:`kernels.rope.apply_rope` (interleaved pairs, trailing dims).
"""

from __future__ import annotations

import math

import torch

from worker.model.config import ModelConfig, YarnScaling


def default_inv_freq(theta: float, rope_dims: int) -> torch.Tensor:
    """``1 / theta^(2i / rope_dims)`` for each rotated pair, float32."""
    return 1.0 / (theta ** (torch.arange(0, rope_dims, 2, dtype=torch.float32) / rope_dims))


def yarn_inv_freq(theta: float, rope_dims: int, yarn: YarnScaling) -> torch.Tensor:
    """YaRN inverse frequencies: interpolated (÷ factor) below the slow correction dim,
    original above the fast one, a linear ramp over pair indices in between.

    The correction range is truncated to whole pair indices (floor / ceil), as DeepSeek's
    reference and transformers do.
    """
    def correction_dim(rotations: float) -> float:
        return (rope_dims * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dims - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(rope_dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                       # weight of the original frequency
    pos_freqs = theta ** (torch.arange(0, rope_dims, 2, dtype=torch.float32) / rope_dims)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (yarn.factor * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep


class RopeTables:
    """Precomputed cos/sin for every position below ``max_positions``, both tables."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str | None = None) -> None:
        rd = cfg.qk_rope_head_dim
        main = default_inv_freq(cfg.rope_theta, rd)
        if cfg.compress_rope_scaling is None:
            compress = default_inv_freq(cfg.compress_rope_theta, rd)
        else:
            compress = yarn_inv_freq(cfg.compress_rope_theta, rd, cfg.compress_rope_scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        self.max_positions = max_positions
        self.inv_freq = {"main": main, "compress": compress}
        self._cos: dict[str, torch.Tensor] = {}
        self._sin: dict[str, torch.Tensor] = {}
        for name, inv in self.inv_freq.items():
            freqs = pos[:, None] * inv[None, :]
            self._cos[name] = freqs.cos().to(device)
            self._sin[name] = freqs.sin().to(device)

    def at(self, table: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[len(positions), rope_dims // 2]`` for ``table`` in {"main", "compress"}."""
        return self._cos[table][positions], self._sin[table][positions]

    def span(self, table: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the contiguous positions ``[start, end)``."""
        if end > self.max_positions:
            raise ValueError(f"position {end - 1} is beyond the rotary table ({self.max_positions} positions); "
                             f"raise max_position_embeddings")
        return self._cos[table][start:end], self._sin[table][start:end]


def table_for(cfg: ModelConfig, layer: int) -> str:
    """Which rotary table a layer uses: sliding-only layers "main", CSA/HCA "compress"."""
    return "compress" if cfg.compress_ratios[layer] else "main"
