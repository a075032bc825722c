"""The lightning indexer of CSA layers (research note §3).

It owns a second overlapping compressor at ``index_head_dim`` whose entries are the
indexer keys, and scores each query against every visible key:

    score(t, w) = Σ_h w_t[h] · ReLU(q_t[h] · K_w),   q_t = RoPE(W_q qr_t),  w_t = W_w x_t / √(d_I n_I)

then keeps the top ``index_topk`` visible entries (``w < (t + 1) // m``), −1 where fewer are
visible. Scoring and selection are :func:`kernels.indexer.indexer_topk_many` (every request
of a forward at once, each row as :func:`kernels.indexer.indexer_topk` selects it), whose
tie-break (lower entry index first) makes every chunk schedule select the same set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kernels.indexer import indexer_topk_many
from kernels.rope import apply_rope
from worker.model.compressor import Compressor
from worker.model.config import ModelConfig
from worker.model.linear import Linear
from worker.model.rope import RopeTables
from worker.model.state import CompressorSlot, Span


#: One request's queries ``[T, n_heads, width]``, its indexer keys ``[N, width]``, weights
#: ``[T, n_heads]`` and positions ``[T]``.
IndexerPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class IndexerScorer(nn.Module):
    """Per-head query weights ``w_t`` (HF name ``scorer.weights_proj``)."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """Indexer-key compressor plus the query side of the indexer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_ratio, overlap=True, eps=cfg.rms_norm_eps)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = IndexerScorer(cfg.hidden_size, cfg.index_n_heads)
        self.weight_scale = (cfg.index_head_dim ** -0.5) * (cfg.index_n_heads ** -0.5)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """The query side for a whole batch: rotated queries ``[N, n_heads, width]`` and the
        per-head weights ``[N, n_heads]``."""
        cos, sin = rope.at("compress", positions)
        q = apply_rope(self.q_b_proj(qr).view(-1, self.n_heads, self.width), cos, sin)
        return q, self.scorer.weights_proj(x) * self.weight_scale

    def part(self, kv: torch.Tensor, score: torch.Tensor, q: torch.Tensor, w: torch.Tensor, span: Span,
             slot: CompressorSlot, rope: RopeTables, block_size: int) -> IndexerPart:
        """One request's rows: emit its indexer keys; what :meth:`select` needs of it."""
        n = self.absorb(kv, score, span, slot, rope, block_size)
        return q, slot.entries(n), w, span.positions

    def select(self, parts: Sequence[IndexerPart]) -> torch.Tensor:
        """The entries each query of the forward picks, ``[ΣT, index_topk]``, the parts' rows in order."""
        return indexer_topk_many(parts, self.ratio, self.topk)
