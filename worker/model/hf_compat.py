"""Bridge to Hugging Face transformers, for parity tests only.

``transformers`` is a test dependency; nothing in the serving path imports this module.
"""

from __future__ import annotations

from worker.model.config import ConfigError, ModelConfig

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def to_hf_config(cfg: ModelConfig):
    """The ``DeepseekV4Config`` describing the same model (fp32, eager attention).

    HF has one compression rate per layer type, so every HCA layer must share one ratio.
    """
    from transformers import DeepseekV4Config

    hca = sorted({cfg.compress_ratios[i] for i in cfg.hca_layers})
    if len(hca) > 1:
        raise ConfigError(f"compress_ratios {list(cfg.compress_ratios)}: HF allows one HCA ratio, got {hca}")
    layer_types = [SLIDING if r == 0 else CSA if r == cfg.csa_ratio else HCA for r in cfg.compress_ratios]
    y = cfg.compress_rope_scaling
    rope = ({} if y is None else
            {"rope_type": "yarn", "factor": y.factor, "original_max_position_embeddings":
             y.original_max_position_embeddings, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow})
    hf = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=1, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        partial_rotary_factor=cfg.qk_rope_head_dim / cfg.head_dim,
        num_experts_per_tok=cfg.num_experts_per_tok, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, scoring_func=cfg.scoring_func,
        routed_scaling_factor=cfg.routed_scaling_factor, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, layer_types=layer_types,
        compress_rates={CSA: cfg.csa_ratio, HCA: hca[0] if hca else 128},
        compress_rope_theta=cfg.compress_rope_theta, rope_parameters=rope or None,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        mlp_layer_types=list(cfg.mlp_layer_types), swiglu_limit=cfg.swiglu_limit,
        sliding_window=cfg.sliding_window, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        num_nextn_predict_layers=0, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False,
    )
    hf._attn_implementation = "eager"
    return hf


def to_hf_model(model):
    """A ``DeepseekV4ForCausalLM`` holding the same weights as ``model`` (float32, eval)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)  # HF initialises before we overwrite; keep that deterministic too
    hf = DeepseekV4ForCausalLM(to_hf_config(model.cfg)).float().eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(f"HF model names differ: missing {missing}, unexpected {unexpected}")
    return hf
