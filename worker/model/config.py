"""Model configuration: the sizes of a DeepSeek-V4-style hybrid-attention model.

Field names follow Hugging Face's ``DeepseekV4Config`` where the two mean the same thing.
Two deliberate differences:

* the attention schedule is ``compress_ratios`` (one ratio per layer, DeepSeek's reference
  name): 0 = sliding window only, ``csa_ratio`` = CSA (overlapping compressor + lightning
  indexer), any other ratio = HCA (non-overlapping heavy compression). The reference decides
  overlap and indexer by ``compress_ratio == 4`` in the same way;
* the rotary dims are ``qk_rope_head_dim`` (an int) rather than ``partial_rotary_factor``.

The default is the tiny CPU-testable config of research note §6.1. Every invariant a
forward pass relies on is checked in ``__post_init__`` and reported with the field's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A model or cache-geometry setting is impossible; the message names the field."""


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN frequency interpolation for the compress rotary table (no logit mscale)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Frozen sizes of one model. ``ModelConfig()`` is the tiny default."""

    model_id: str = "kvledger/dsv4-tiny"
    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 6
    #: Per layer: 0 = sliding window only, ``csa_ratio`` = CSA, other nonzero = HCA.
    compress_ratios: tuple[int, ...] = (0, 0, 4, 16, 4, 16)
    #: The ratio that marks a CSA layer (overlapping windows + lightning indexer).
    csa_ratio: int = 4
    num_attention_heads: int = 4
    head_dim: int = 64
    qk_rope_head_dim: int = 16
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    sliding_window: int = 32
    index_n_heads: int = 8
    index_head_dim: int = 32
    index_topk: int = 4
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    mlp_layer_types: tuple[str, ...] = ("hash_moe", "moe", "moe", "moe", "moe", "moe")
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    #: YaRN on the compress table (CSA/HCA layers); ``None`` = plain RoPE there too.
    compress_rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "hc_mult",
                    "hc_sinkhorn_iters", "n_routed_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "max_position_embeddings", "csa_ratio")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n:
            raise ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries; "
                              f"num_hidden_layers is {n}: give one ratio per layer")
        if any(r < 0 for r in self.compress_ratios):
            raise ConfigError(f"compress_ratios {self.compress_ratios}: ratios must be >= 0 (0 = sliding only)")
        if len(self.mlp_layer_types) != n:
            raise ConfigError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries; "
                              f"num_hidden_layers is {n}")
        bad = [t for t in self.mlp_layer_types if t not in ("hash_moe", "moe")]
        if bad:
            raise ConfigError(f"mlp_layer_types: {bad} not allowed; use 'hash_moe' or 'moe'")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ConfigError(f"qk_rope_head_dim {self.qk_rope_head_dim}: must be even, > 0 and <= head_dim "
                              f"({self.head_dim})")
        if self.csa_layers and (self.index_n_heads <= 0 or self.index_topk <= 0):
            raise ConfigError("index_n_heads and index_topk must be > 0 when a layer is CSA")
        if self.csa_layers and (self.index_head_dim < self.qk_rope_head_dim or self.index_head_dim % 2):
            raise ConfigError(f"index_head_dim {self.index_head_dim}: must be even and >= qk_rope_head_dim "
                              f"({self.qk_rope_head_dim}) (the indexer rotates its trailing rope dims)")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"o_groups {self.o_groups} must divide num_attention_heads*head_dim "
                              f"({self.num_attention_heads * self.head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} > n_routed_experts "
                              f"{self.n_routed_experts}")
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts {self.n_shared_experts}: this implementation has exactly one "
                              f"shared expert (as DeepSeek-V4)")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func {self.scoring_func!r}: only 'sqrtsoftplus' is implemented")
        if self.hc_mult < 1:
            raise ConfigError("hc_mult must be >= 1")

    # ---- derived schedule -------------------------------------------------------------

    @property
    def csa_layers(self) -> tuple[int, ...]:
        """Layers with overlapping compression and a lightning indexer."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == self.csa_ratio)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        """Layers with non-overlapping heavy compression (no indexer)."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r and r != self.csa_ratio)

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        """CSA and HCA layers, in layer order."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r)

    def is_csa(self, layer: int) -> bool:
        return self.compress_ratios[layer] == self.csa_ratio

    def replace(self, **changes) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def check_block_size(cfg: ModelConfig, block_size: int) -> None:
    """Raise :class:`ConfigError` unless ``block_size`` fits the model's compression grid.

    Every block boundary must also be a compression boundary of every compressed layer, so
    that a block's compressed entries depend only on tokens up to its end and the
    compressor state at a boundary is just the CSA overlap halo.
    """
    if block_size <= 0:
        raise ConfigError(f"block_size must be > 0, got {block_size}")
    bad = sorted({r for r in cfg.compress_ratios if r and block_size % r})
    if bad:
        raise ConfigError(f"block_size {block_size} must be a multiple of every nonzero compress ratio; "
                          f"it is not a multiple of {bad} (compress_ratios {list(cfg.compress_ratios)})")
