"""The YOCO decoder-decoder on the shared batched-forward skeleton (``worker.model.lm``).

Module names (they are the checkpoint's tensor names, ``worker.model.yoco.checkpoint``)::

    model.embed_tokens                      token embedding
    model.self_layers.N.*                   self-decoder: dense layers with sliding-window attention
                                            (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
                                            ``input_layernorm``, ``post_attention_layernorm``)
    model.kv_norm, model.k_proj, model.v_proj
                                            the global K/V: RMSNorm of the self-decoder's output,
                                            then one K and one V projection (K rotated)
    model.cross_layers.N.*                  cross-decoder: ``cross_attn.{q,o}_proj`` (no K/V of its
                                            own), ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``
    model.norm, lm_head                     final norm and head (tied to the embedding if configured)
    vision.*                                the vision encoder, when the config declares one

**Only what the logits need.** A forward runs the self-decoder over every row and projects
every row's global K/V (later tokens attend to them), then runs the cross-decoder on the rows
whose logits are wanted (``_hidden``'s ``need``: a prompt piece's last row, every decode
token) — the cross-decoder is half the layers and, for a prompt, almost none of the rows.

**Exactness.** Every product is :class:`worker.model.linear.Linear`, pointwise ops go
through ``kernels.invariant.pointwise``, and both attentions are
:func:`worker.model.dense.attention.attend` (key pieces anchored at absolute positions): a
row's bits depend on its own tokens only, so running the cross-decoder on fewer rows, fusing
requests, cutting prompts anywhere and resuming from cached blocks all leave every logit as a
cold run computes it.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.invariant import KEY_CHUNK, attention, attention_serves
from worker.model.dense.attention import attend
from worker.model.dense.model import DenseLayer, DenseMLP, RopeTable, rotate_half, seed_weights
from worker.model.linear import Linear
from worker.model.lm import CausalLM
from worker.model.norms import CastRMSNorm as RMSNorm
from worker.model.state import Batch
from worker.model.vision import VisionEncoder
from worker.model.yoco.config import YocoConfig
from worker.model.yoco.state import YocoState, yoco_form_layouts


class CrossAttention(nn.Module):
    """Queries of the rows that need them, over the request's global K/V (causal, whole history)."""

    def __init__(self, cfg: YocoConfig) -> None:
        super().__init__()
        H, D = cfg.num_attention_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = H, cfg.num_key_value_heads, D
        self.q_proj = Linear(cfg.hidden_size, H * D, bias=False)
        self.o_proj = Linear(H * D, cfg.hidden_size, bias=False)
        self.scale = D ** -0.5

    def forward(self, x: torch.Tensor, groups: list[tuple[list, torch.Tensor, torch.Tensor]],
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[R, hidden]`` (the rows that need it); ``groups``: requests with the same number of
        such rows, each ``(states, row indices into x [S, n], positions [S, n])``."""
        R = x.shape[0]
        q = rotate_half(self.q_proj(x).view(R, self.heads, self.head_dim), cos, sin)
        o = q.new_empty(q.shape)
        for states, rows, pos in groups:
            S, n = rows.shape
            kv = [st.global_keys(int(p.max()) + 1) for st, p in zip(states, pos)]
            if attention_serves(q, kv[0][0]):
                # each request's rows over its own global K/V where they lie (kernels.invariant)
                flat = rows.reshape(-1)
                out = attention(q[flat], kv, list(range(0, S * n + 1, n)), pos.reshape(-1), [0] * S, 0, self.scale)
                o[flat] = out.to(q.dtype)
                continue
            if S == 1:
                keys, values = kv[0][0][None], kv[0][1][None]
            else:
                # one zero-padded [S, L, kvh, D] per side, L a whole number of key pieces
                L = -(-max(k.shape[0] for k, _ in kv) // KEY_CHUNK) * KEY_CHUNK
                keys = kv[0][0].new_zeros(S, L, self.kv_heads, self.head_dim)
                values = torch.zeros_like(keys)
                for i, (k, v) in enumerate(kv):
                    keys[i, :k.shape[0]] = k
                    values[i, :v.shape[0]] = v
            flat = rows.reshape(-1)
            out = attend(q[flat].view(S, n, self.heads, self.head_dim), keys, values, pos,
                         torch.zeros(S, dtype=torch.long, device=x.device), 0, self.scale)
            o[flat] = out.reshape(-1, self.heads, self.head_dim)
        return self.o_proj(o.reshape(R, -1))


class CrossLayer(nn.Module):
    def __init__(self, cfg: YocoConfig) -> None:
        super().__init__()
        self.cross_attn = CrossAttention(cfg)
        self.mlp = DenseMLP(cfg.self_decoder())
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, groups, cos, sin):
        x = x + self.cross_attn(self.input_layernorm(x), groups, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class YocoBackbone(nn.Module):
    def __init__(self, cfg: YocoConfig) -> None:
        super().__init__()
        dense = cfg.self_decoder()
        kvh, D = cfg.num_key_value_heads, cfg.head_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.self_layers = nn.ModuleList(DenseLayer(dense, i) for i in range(cfg.num_self_decoder_layers))
        self.kv_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.k_proj = Linear(cfg.hidden_size, kvh * D, bias=False)
        self.v_proj = Linear(cfg.hidden_size, kvh * D, bias=False)
        self.cross_layers = nn.ModuleList(CrossLayer(cfg) for _ in range(cfg.num_cross_decoder_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class YocoLM(CausalLM):
    """A YOCO decoder-decoder (see the module docstring and :mod:`worker.model.yoco.config`)."""

    family = "yoco"

    def __init__(self, cfg: YocoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = YocoBackbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.vision = VisionEncoder(cfg.vision, cfg.hidden_size) if cfg.vision is not None else None
        self.rope = RopeTable(cfg.self_decoder(), torch.float32)
        #: Rows the last forward ran the cross-decoder on (the benchmark and tests read it).
        self.cross_rows = 0

    def _apply(self, fn, *args, **kwargs):
        # the rotary table follows the parameters (a plain tensor: not in the state dict or the digest)
        out = super()._apply(fn, *args, **kwargs)
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RopeTable(self.cfg.self_decoder(), self.dtype, self.device)
        return out

    def new_state(self, block_size: int, capacity: int | None = None, *,
                  cache_dtype: str | None = None) -> YocoState:
        return YocoState(self.cfg, block_size, capacity, dtype=self.dtype, device=self.device,
                         cache_dtype=cache_dtype or self.cache_dtype)

    def form_layouts(self, block_size: int, cache_dtype: str | None = None) -> dict:
        return yoco_form_layouts(self.cfg, block_size, self.dtype, cache_dtype or self.cache_dtype)

    def _self_decode(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The self-decoder over every row, and every row's global K/V written to its state."""
        m = self.model
        x = self._embed(ids, batch)
        cos, sin = self.rope.at(batch.positions)
        for layer in m.self_layers:
            x = layer(x, batch, cos, sin)
        kx = m.kv_norm(x)
        N, kvh, D = x.shape[0], self.cfg.num_key_value_heads, self.cfg.head_dim
        k = rotate_half(m.k_proj(kx).view(N, kvh, D), cos, sin)
        v = m.v_proj(kx).view(N, kvh, D)
        for g in batch.segments:
            g.state.write_global(g.span.start, k[g.rows], v[g.rows])
        return x

    def _body(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self._hidden(ids, batch, None)

    def _hidden(self, ids: torch.Tensor, batch: Batch, need: torch.Tensor | None) -> torch.Tensor:
        x = self._self_decode(ids, batch)
        rows = torch.arange(x.shape[0], device=x.device) if need is None else need
        # group the needed rows by request; requests with as many such rows share attention calls
        by_count: dict[int, list] = {}
        for g in batch.segments:
            mine = rows[(rows >= g.rows.start) & (rows < g.rows.stop)]
            by_count.setdefault(int(mine.numel()), []).append((g, mine))
        index = {int(r): j for j, r in enumerate(rows.tolist())}     # batch row → row of h
        groups = []
        for n, items in by_count.items():
            if n == 0:
                continue
            states = [g.state for g, _ in items]
            local = torch.tensor([[index[int(r)] for r in mine.tolist()] for _, mine in items], device=x.device)
            pos = torch.stack([batch.positions[mine] for _, mine in items])
            groups.append((states, local, pos))
        h = x[rows]
        cos, sin = self.rope.at(batch.positions[rows])
        for layer in self.model.cross_layers:
            h = layer(h, groups, cos, sin)
        self.cross_rows = int(rows.numel())
        return h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))


def build_yoco(cfg: YocoConfig | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> YocoLM:
    """A YOCO model with seeded weights (the dense family's rule, ``seed_weights``), in eval mode."""
    return seed_weights(YocoLM(cfg or YocoConfig()), seed).to(dtype).eval()
