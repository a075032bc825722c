"""ModelConfig validation: impossible settings fail with the field's name."""

from __future__ import annotations

import pytest

from worker.model import ConfigError, ModelConfig, check_block_size


def test_tiny_default_matches_research_config() -> None:
    c = ModelConfig()
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (256, 64, 6)
    assert c.compress_ratios == (0, 0, 4, 16, 4, 16)
    assert c.csa_layers == (2, 4) and c.hca_layers == (3, 5) and c.compressed_layers == (2, 3, 4, 5)
    assert (c.num_attention_heads, c.head_dim, c.qk_rope_head_dim) == (4, 64, 16)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.sliding_window) == (32, 2, 16, 32)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (8, 32, 4)
    assert (c.hc_mult, c.hc_sinkhorn_iters) == (4, 20)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (4, 2, 1, 64)
    assert c.mlp_layer_types == ("hash_moe",) + ("moe",) * 5
    assert c.compress_rope_scaling is not None and c.compress_rope_scaling.factor == 16


@pytest.mark.parametrize("changes, field", [
    (dict(compress_ratios=(0, 4, 16)), "compress_ratios"),
    (dict(compress_ratios=(0, 0, -4, 16, 4, 16)), "compress_ratios"),
    (dict(mlp_layer_types=("moe",) * 5), "mlp_layer_types"),
    (dict(mlp_layer_types=("dense",) * 6), "mlp_layer_types"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(qk_rope_head_dim=128), "qk_rope_head_dim"),
    (dict(o_groups=3), "o_groups"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(index_head_dim=8), "index_head_dim"),
    (dict(scoring_func="softmax"), "scoring_func"),
])
def test_invalid_config_names_the_field(changes, field) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**changes)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ModelConfig().hidden_size = 128  # type: ignore[misc]


@pytest.mark.parametrize("bs, ok", [(16, True), (32, True), (48, True), (4, False), (8, False), (24, False)])
def test_block_size_rule(bs, ok) -> None:
    if ok:
        check_block_size(ModelConfig(), bs)
    else:
        with pytest.raises(ConfigError, match="block_size"):
            check_block_size(ModelConfig(), bs)
