"""One hybrid-attention layer: sliding window, plus CSA or HCA compressed history.

Per token (research note §1.2–1.4):

    qr = RMSNorm(W_qa x);  q = rms(W_qb qr) per head;  kv = RMSNorm(W_kv x)     (one K=V head)
    RoPE (interleaved, trailing rope dims) on q and kv at the token's position

Keys of query ``t``: the window rows ``[t - W + 1, t]`` and the compressed entries it may
use — all visible ones (``w < (t + 1) // m``) for HCA, the indexer's top-k for CSA. One
softmax over them with the per-head sink in the denominator
(:func:`kernels.sparse_attention.sparse_attn`); the output's rope dims are rotated back
at ``t`` (V carries the keys' rotation), then the grouped low-rank output projection.

Sliding-only layers use the "main" rotary table, CSA/HCA layers the "compress" table for
every rotation they do.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.invariant import bmm_rows
from kernels.rope import apply_rope
from kernels.sparse_attention import sparse_attn
from worker.model.compressor import Compressor
from worker.model.config import ModelConfig
from worker.model.indexer import Indexer, IndexerPart
from worker.model.linear import Linear
from worker.model.norms import RMSNorm, rms_normalize
from worker.model.rope import RopeTables, table_for
from worker.model.state import IDX, MAIN, Batch


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group ``g`` of the heads' output → ``o_lora_rank`` dims.

    The weight is stored as HF's ``o_a_proj.weight``: ``[groups * out, in_per_group]``.
    """

    def __init__(self, in_per_group: int, out_per_group: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))
        #: What ``check_invariance`` probes for this product.
        self.grouped_shape = (groups, in_per_group, out_per_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, groups, in_per_group]`` → ``[T, groups * out_per_group]``."""
        w = self.weight.view(self.groups, -1, x.shape[-1])                # [G, out, in]
        y = bmm_rows(x.transpose(0, 1), w.transpose(1, 2))               # [G, T, out]
        return y.transpose(0, 1).reshape(x.shape[0], -1)


class Attention(nn.Module):
    """Weights and forward of one attention layer; names follow the HF checkpoint."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ratio = cfg.compress_ratios[layer]
        self.table = table_for(cfg, layer)
        H, D = cfg.num_attention_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, H * D, bias=False)
        self.kv_proj = Linear(cfg.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, eps)
        self.o_a_proj = GroupedLinear(H * D // cfg.o_groups, cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        self.compressor: Compressor | None = None
        if self.ratio:
            csa = cfg.is_csa(layer)
            self.compressor = Compressor(cfg.hidden_size, D, self.ratio, overlap=csa, eps=eps)
            if csa:
                self.compressor.indexer = Indexer(cfg)
        self.scale = D ** -0.5

    def forward(self, x: torch.Tensor, batch: Batch, rope: RopeTables) -> torch.Tensor:
        """x ``[N, hidden]`` (the normed attention input of every segment's rows) → ``[N, hidden]``.

        Projections run on the whole batch; what reads or writes cached state (window rows, the
        compressors' rings and entries, the indexer's selection) runs per segment; then one
        attention call serves every query of the batch. Each query's key columns are laid out
        by its own position only — its window (``W`` columns), then its compressed entries in
        entry order — and padded with masked columns, which the attention kernel ignores
        exactly; so a query's output is the same alone, in a prefill unit or in any batch.
        """
        cfg, N = self.cfg, batch.rows
        H, D, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        dev = x.device
        cos, sin = rope.at(self.table, batch.positions)
        qr = self.q_a_norm(self.q_a_proj(x))
        q = rms_normalize(self.q_b_proj(qr).view(N, H, D), cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        comp = self.compressor
        if comp is not None:
            ckv, cscore = comp.project(x, batch.positions)
            if comp.overlap:
                ikv, iscore = comp.indexer.project(x, batch.positions)
                iq, iw = comp.indexer.queries(x, qr, batch.positions, rope)

        # Per segment: what touches its state. Keys are every segment's window rows and
        # entries, concatenated; each query's columns index its own segment's rows.
        keys: list[torch.Tensor] = []
        win_off: list[int] = []          # per segment: key row of its window's first position, minus lo
        ent_off: list[int] = []          # per segment: key row of its entry 0
        n_ent: list[int] = []
        parts: list[IndexerPart] = []   # per segment, for the indexer's one selection
        rows = 0
        for seg in batch.segments:
            span, state, r = seg.span, seg.state, seg.rows
            state.write_swa(self.layer, span.start, kv[r])
            lo = max(0, span.start - W + 1)
            window = state.window_rows(self.layer, lo, span.end)
            keys.append(window)
            win_off.append(rows - lo)
            rows += window.shape[0]
            if comp is not None:
                slot = state.compressor(self.layer, MAIN)
                n = comp.absorb(ckv[r], cscore[r], span, slot, rope, state.block_size)
                if comp.overlap:
                    parts.append(comp.indexer.part(ikv[r], iscore[r], iq[r], iw[r], span,
                                                   state.compressor(self.layer, IDX), rope, state.block_size))
                keys.append(slot.entries(n))
                ent_off.append(rows)
                n_ent.append(n)
                rows += n
        counts = [seg.span.length for seg in batch.segments]
        one = len(counts) == 1

        def per_row(values: list[int]) -> torch.Tensor:
            t = torch.tensor(values, device=dev)
            return t if one else t.repeat_interleave(torch.tensor(counts, device=dev))

        # Window columns: positions [t - W + 1, t]; -1 before position 0.
        positions = batch.positions.unsqueeze(1)
        pos = positions - (W - 1) + torch.arange(W, device=dev)                # [N, W]
        idx = torch.where(pos >= 0, pos + per_row(win_off).unsqueeze(1), torch.full_like(pos, -1))
        if comp is not None:
            base = per_row(ent_off).unsqueeze(1)
            if comp.overlap:
                # Only the picked entries join the query's columns (k per query, not the history).
                picked = comp.indexer.select(parts)                                     # [N, k]
                ent = torch.where(picked >= 0, picked + base, picked)
            else:
                j = torch.arange(max(n_ent), device=dev).unsqueeze(0)                  # entry ids
                visible = j < (positions + 1) // self.ratio
                ent = torch.where(visible, j + base, torch.full_like(visible, -1, dtype=torch.long))
            idx = torch.cat([idx, ent], 1)
        o = sparse_attn(q, torch.cat(keys, 0) if len(keys) > 1 else keys[0], idx, self.sinks, self.scale)
        o = apply_rope(o, cos, sin, inverse=True)
        o = self.o_a_proj(o.reshape(N, cfg.o_groups, -1))
        return self.o_b_proj(o)
