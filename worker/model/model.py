"""The DeepSeek-V4-style hybrid-attention language model and its prefill/decode schedule.

Structure (parameter names follow the Hugging Face checkpoint): token embedding repeated
into ``hc_mult`` residual streams; per layer an mHC-wrapped attention (sliding window +
CSA or HCA, ``worker.model.attention``) and an mHC-wrapped MoE; then the hyper-head
collapse, RMSNorm and the LM head. The model keeps no per-request state of its own: all of
it lives in a :class:`worker.model.state.RequestState`, which the model touches only
through that object's methods.

Exactness
---------
Every op is batch-invariant (``kernels.invariant``): a row's bits depend only on its own
inputs, never on how many rows share the forward, which other requests they belong to, or
where a prompt was cut. So :meth:`HybridAttentionLM.forward_batch` over several requests gives
each the logits it gets alone; a prompt prefilled in units of any size gives the same bits
(``bench.model`` reports ``unit4_bit_identical_to_unit1``); a block completed by decode steps
equals the prefilled one; and a request resumed at any block boundary computes exactly what a
cold run computes from there. This holds on the CPU path with one intra-op thread, checked at
start by :meth:`HybridAttentionLM.check_invariance`; where it does not hold
(:attr:`HybridAttentionLM.batch_invariant` False) the model refuses fused forwards and only
blocks of block-aligned units are exportable (:meth:`RequestState.commit`) — the older rule,
which :meth:`HybridAttentionLM.prefill`'s grid-anchored units (``chunk_blocks``) keep exact.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.attention import Attention
from worker.model.config import ModelConfig
from worker.model.forms import form_layouts
from worker.model.hyper_connections import HyperConnection, HyperHead
from worker.model.linear import Linear
from worker.model.lm import CausalLM
from worker.model.moe import MoE
from worker.model.norms import RMSNorm
from worker.model.rope import RopeTables
from worker.model.state import Batch, RequestState


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.attn_hc = HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.ffn_hc = HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)

    def forward(self, streams, token_ids, batch, rope):
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, post, comb,
                                        self.self_attn(self.input_layernorm(x), batch, rope))
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(streams, post, comb, self.mlp(self.post_attention_layernorm(x), token_ids))


class Backbone(nn.Module):
    """HF ``model.*``: embeddings, layers, final hyper-head and norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)


class HybridAttentionLM(CausalLM):
    """The language model. Build initialised weights with :func:`worker.model.weights.build_model`."""

    family = "deepseek_v4"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RopeTables(cfg, cfg.max_position_embeddings)

    def _apply(self, fn, *args, **kwargs):
        # Keep the rotary tables on the parameters' device (they are plain tensors, not
        # buffers, so they stay out of the state dict and the weights digest).
        out = super()._apply(fn, *args, **kwargs)
        self.rope = RopeTables(self.cfg, self.cfg.max_position_embeddings, device=self.lm_head.weight.device)
        return out

    def _product_shapes(self) -> set[tuple[int, int]]:
        cfg = self.cfg
        return super()._product_shapes() | {
            (cfg.hidden_size, 2 * cfg.moe_intermediate_size), (cfg.moe_intermediate_size, cfg.hidden_size),
            (cfg.hidden_size, cfg.n_routed_experts), (cfg.hc_mult * cfg.hidden_size, cfg.hc_mult),
            (cfg.hc_mult * cfg.hidden_size, (2 + cfg.hc_mult) * cfg.hc_mult)}

    def new_state(self, block_size: int, capacity: int | None = None, *,
                  cache_dtype: str | None = None) -> RequestState:
        """A fresh per-request state on this model's device."""
        return RequestState(self.cfg, block_size, capacity, device=self.device,
                            cache_dtype=cache_dtype or self.cache_dtype)

    def form_layouts(self, block_size: int, cache_dtype: str | None = None) -> dict:
        return form_layouts(self.cfg, block_size, cache_dtype or self.cache_dtype)

    def _body(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = self._embed(ids, batch)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, ids, batch, self.rope)
        return streams

    def _head(self, streams: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(self.model.hc_head(streams)))
