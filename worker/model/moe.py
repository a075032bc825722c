"""Mixture of experts: routed SwiGLU experts plus one shared expert, in every layer.

Router score ``sqrt(softplus(logit))``. A learned router picks the top-k experts by
``score + e_score_correction_bias``; a hash router (the first layers, ``hash_moe``) takes
them from a frozen table ``tid2eid[token id]``. Either way the chosen experts' scores are
renormalised to sum to one and scaled by ``routed_scaling_factor``. Experts clamp the gate
from above and the up projection on both sides at ``swiglu_limit``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.invariant import linear, pointwise
from worker.model.config import ModelConfig
from worker.model.linear import Linear


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return pointwise(F.silu, gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


class Router(nn.Module):
    """Top-k learned routing (``mlp_layer_types == "moe"``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.scaling = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = pointwise(_sqrt_softplus, linear(x, self.weight))
        ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class HashRouter(nn.Module):
    """Routing by token id (``mlp_layer_types == "hash_moe"``); the gate still weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = pointwise(_sqrt_softplus, linear(x, self.weight))
        ids = self.tid2eid[token_ids].long()
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class Experts(nn.Module):
    """Routed experts as stacked weights (HF names ``gate_up_proj``, ``down_proj``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, I, Hd = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, Hd))
        self.down_proj = nn.Parameter(torch.empty(E, Hd, I))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # NOTE: experts are visited in ascending order and each adds into `out`, so the sum
        # order per token is fixed by its expert ids alone, whatever else is in the batch.
        for e in torch.unique(ids).tolist():
            tok, k = torch.where(ids == e)
            gate, up = linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = linear(_swiglu(gate, up, self.limit), self.down_proj[e]) * weights[tok, k, None]
            out.index_add_(0, tok, y)
        return out


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        Hd, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_proj = Linear(Hd, I, bias=False)
        self.up_proj = Linear(Hd, I, bias=False)
        self.down_proj = Linear(I, Hd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.gate = HashRouter(cfg) if cfg.mlp_layer_types[layer] == "hash_moe" else Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]``, token_ids ``[T]`` → ``[T, hidden]``."""
        ids, weights = self.gate(x, token_ids)
        return self.experts(x, ids, weights) + self.shared_experts(x)
