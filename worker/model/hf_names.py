"""The explicit tables from transformers' ``save_pretrained`` checkpoints to this project's models.

DeepSeek-V4: transformers keeps the model in memory under its own names but writes (and
reads) the original DeepSeek names, ``head.weight``, ``model.layers.N.attn.wq_a.weight``,
``ffn.experts.E.w1.weight`` … (its ``conversion_mapping`` for ``deepseek_v4``). Our modules are
named after transformers' in-memory names, so loading is this table, applied per tensor: a
layer's leaf name maps one to one, except the routed experts, whose ``w1``/``w3`` (gate, up)
are stacked into ``gate_up_proj [E, 2I, H]`` and ``w2`` into ``down_proj [E, H, I]``. Names
already in our (in-memory) form pass unchanged, so both kinds of directory load.

The dense families (Llama, Qwen2, Qwen3) are saved under their in-memory names, which are ours.
"""

from __future__ import annotations

import re

#: Top-level DeepSeek-V4 names → ours (both with and without the ``model.`` prefix).
DSV4_TOP = {
    "head.weight": "lm_head.weight",
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

#: A DeepSeek-V4 layer's leaf names (after ``layers.N.``) → ours.
DSV4_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}

#: Checkpoint names that belong to parts this model does not run (multi-token prediction).
DSV4_IGNORED = re.compile(r"^(model\.)?mtp\.")

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


class Stack:
    """Several checkpoint tensors that form one of ours: ``parts[e]`` are concatenated along
    dim 0 per expert ``e``, then the experts are stacked (``gate_up_proj``: ``[w1; w3]`` per expert)."""

    def __init__(self, n: int, width: int) -> None:
        self.parts: list[list[str | None]] = [[None] * width for _ in range(n)]


def dsv4_target(key: str) -> tuple[str, tuple[int, int] | None] | None:
    """Where a DeepSeek-V4 checkpoint tensor goes: ``(our name, None)`` for a one-to-one tensor,
    ``(our stacked name, (expert, slot))`` for a routed expert's piece, ``None`` if the name is
    not in the table (the caller reports it)."""
    bare = key.removeprefix("model.")
    if bare in DSV4_TOP:
        return DSV4_TOP[bare], None
    m = _LAYER.match(key)
    if not m:
        return None
    layer, leaf = m.groups()
    prefix = f"model.layers.{layer}."
    if leaf in DSV4_LAYER:
        return prefix + DSV4_LAYER[leaf], None
    e = _EXPERT.match(leaf)
    if e:
        expert, w = int(e.group(1)), e.group(2)
        if w == "w2":
            return prefix + "mlp.experts.down_proj", (expert, 0)
        return prefix + "mlp.experts.gate_up_proj", (expert, 0 if w == "w1" else 1)
    return None
