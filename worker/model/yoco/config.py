"""Sizes of a YOCO ("You Only Cache Once", Sun et al., 2024) decoder-decoder.

A *self-decoder* of ``num_self_decoder_layers`` efficient layers (sliding-window attention,
GQA, RoPE, SwiGLU) runs over every token; its output is normalised and projected ONCE into a
global K/V (``num_key_value_heads × head_dim`` each); a *cross-decoder* of
``num_cross_decoder_layers`` layers then attends, with its own queries and no K/V of its own,
to that one global K/V. The cache therefore holds one K/V per token for the whole model
(plus the self-decoder's window), not one per layer — and a prompt's tokens need only the
self-decoder and the projection: the cross-decoder runs for the positions whose logits are
wanted.

There is no transformers class for it; kvledger's checkpoint format is a ``config.json`` of
these fields with ``architectures: ["YocoForCausalLM"]`` and safetensors under the module
names of :class:`worker.model.yoco.model.YocoLM` (``worker.model.yoco.checkpoint``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from worker.model.config import ConfigError
from worker.model.dense.config import SLIDING, DenseConfig, RopeSpec
from worker.model.vision import VisionConfig


@dataclass(frozen=True, slots=True)
class YocoConfig:
    """Frozen sizes of one YOCO model. ``YocoConfig()`` is the tiny default (4 layers: 2 + 2)."""

    model_id: str = "kvledger/yoco-tiny"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_self_decoder_layers: int = 2
    num_cross_decoder_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    #: Keys a self-decoder query sees (itself included).
    sliding_window: int = 64
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    rope: RopeSpec = field(default_factory=RopeSpec)
    #: kvledger's vision encoder (``worker.model.vision``): image inputs become these rows.
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_self_decoder_layers",
                     "num_cross_decoder_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "sliding_window", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads {self.num_key_value_heads} must divide num_attention_heads "
                              f"{self.num_attention_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even (rotary pairs)")
        if (self.vision is None) != (self.image_token_id is None):
            raise ConfigError("vision and image_token_id come together: give both or neither")
        if self.image_token_id is not None and not 0 <= self.image_token_id < self.vocab_size:
            raise ConfigError(f"image_token_id {self.image_token_id} must lie in [0, vocab_size {self.vocab_size})")

    @property
    def num_hidden_layers(self) -> int:
        return self.num_self_decoder_layers + self.num_cross_decoder_layers

    def self_decoder(self) -> DenseConfig:
        """The self-decoder as a dense config of sliding-window layers (its layers ARE dense layers)."""
        return DenseConfig(model_id=self.model_id, family="llama", vocab_size=self.vocab_size,
                           hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=self.num_self_decoder_layers,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
                           layer_types=(SLIDING,) * self.num_self_decoder_layers,
                           sliding_window=self.sliding_window, rope=self.rope)

    def replace(self, **changes) -> YocoConfig:
        return dataclasses.replace(self, **changes)
