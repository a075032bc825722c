"""The dense decoder (Llama / Qwen2 / Qwen3) on the shared batched-forward skeleton.

Module and parameter names are transformers' (``model.layers.N.self_attn.q_proj.weight`` …), so
a ``save_pretrained`` directory loads by name (:mod:`worker.model.checkpoint`). Every product is
:class:`worker.model.linear.Linear` (batch-invariant rows), elementwise transcendental functions
go through ``kernels.invariant.pointwise``, and attention is :func:`worker.model.dense.attention.attend`,
so a request's logits are the same alone, fused with others, prefilled in any units, or resumed
from cached K/V at any block boundary — in whatever dtype the model computes in.

Norms follow transformers' ``LlamaRMSNorm``: normalise in float32, cast back, then the weight.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import invariant, layer_ops
from kernels.invariant import VECTOR_PAD, KEY_CHUNK, attention, attention_cached, attention_serves, compiled_serves
from kernels.layer_ops import compiled_for, rope, silu_mul
from worker.model.dense.attention import attend
from worker.model.dense.config import DenseConfig, rope_inv_freq
from worker.model.dense.state import DenseState, dense_form_layouts
from worker.model.linear import Fused, Linear
from worker.model.lm import CausalLM
from worker.model.norms import CastRMSNorm as RMSNorm
from worker.model.seeding import tensor_generator
from worker.model.state import Batch
from worker.model.vision import VisionEncoder


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE (transformers' ``rotate_half``): ``x·cos + [−x₂, x₁]·sin``;
    ``x`` ``[N, heads, D]``, cos/sin ``[N, D]`` (``kernels.layer_ops.rope``: one compiled call
    with the torch expression's bits)."""
    return rope(x, cos, sin)


def _in_place(batch: Batch, dtype: torch.dtype) -> tuple[list, list[int], list[int], list[torch.Tensor], int] | None:
    """The batch's K/V buffers, span starts, row bounds, each request's table of restored blocks read
    where the cache holds them (``DenseState.prefix_table``) and the block size, where every
    request's state keeps its rows in ``dtype`` in place (``DenseState.buffers_for``); else None.
    Once per forward."""
    key = ("dense_in_place", dtype)
    if key not in batch.memo:
        segs = batch.segments
        bufs = [getattr(g.state, "buffers_for", _none)(dtype) for g in segs]
        batch.memo[key] = None if any(b is None for b in bufs) else (
            bufs, [g.span.start for g in segs], [g.rows.start for g in segs] + [batch.rows],
            [g.state.prefix_table() for g in segs], segs[0].state.block_size)
    return batch.memo[key]


def _none(_dtype: torch.dtype) -> None:
    return None


def _in_place_lists(batch: Batch, dtype: torch.dtype, window: int) -> tuple | None:
    """:func:`_in_place` as ``dense_layer`` takes it — the K buffers, the V buffers, span starts, row
    bounds, and each request's first key for ``window`` — made once per forward, not per layer."""
    key = ("dense_layer_args", dtype, window)
    if key not in batch.memo:
        plan = _in_place(batch, dtype)
        batch.memo[key] = None if plan is None else (
            [b[0] for b in plan[0]], [b[1] for b in plan[0]], plan[1], plan[2],
            [max(0, g.span.start - window + 1) if window else 0 for g in batch.segments], plan[3], plan[4])
    return batch.memo[key]


class _Memo:
    """One cached value that a copy or a pickle of its holder starts without (it may hold a module)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: tuple | None = None

    def __deepcopy__(self, memo: dict) -> _Memo:
        return _Memo()

    def __reduce__(self) -> tuple:
        return _Memo, ()


def _unchanged(refs: list[tuple]) -> bool:
    """Whether every parameter a :class:`DenseLayer` cached is still its module's, at the address and
    version it was cached at (a replaced parameter, ``.data`` reassigned, or an in-place change: no)."""
    for params, name, t, ptr, version in refs:
        if params.get(name) is not t or t.data_ptr() != ptr or t._version != version:
            return False
    return True


class RopeTable:
    """cos/sin ``[max_positions, head_dim]`` (pairs repeated as ``cat(f, f)``), in the model's dtype."""

    def __init__(self, cfg: DenseConfig, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        inv, scale = rope_inv_freq(cfg.rope, cfg.head_dim)
        freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], -1)
        self.inv_freq, self.attention_scaling = inv, scale
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


class DenseAttention(nn.Module):
    def __init__(self, cfg: DenseConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.window = layer, cfg.window(layer)
        H, kvh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = H, kvh, D
        self.q_proj = Linear(cfg.hidden_size, H * D, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kvh * D, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kvh * D, bias=cfg.qkv_bias)
        self.o_proj = Linear(H * D, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = D ** -0.5
        self.qkv = Fused(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(x)
        q = q.view(N, self.heads, self.head_dim)
        k = k.view(N, self.kv_heads, self.head_dim)
        v = v.view(N, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            # contiguous first: a reduction over a strided view may take another path through torch
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        segs = batch.segments
        los = [max(0, g.span.start - self.window + 1) if self.window else 0 for g in segs]
        if attention_serves(q, k):
            plan = _in_place(batch, k.dtype)
            if plan is not None:
                # every request's new rows written into its buffers and attended there, in one call
                o = attention_cached(q, k, v, plan[0], self.layer, plan[1], plan[2], batch.positions, los,
                                     self.window, self.scale, plan[3], plan[4])
                return self.o_proj(o.to(q.dtype).reshape(N, -1))
        for seg in segs:
            seg.state.write(self.layer, seg.span.start, k[seg.rows], v[seg.rows])
        kv = [g.state.keys(self.layer, lo, g.span.end) for g, lo in zip(segs, los)]
        if attention_serves(q, kv[0][0]):
            # every request's rows over its own K/V where they lie, in one call (kernels.invariant)
            bounds = [g.rows.start for g in segs] + [N]
            o = attention(q, kv, bounds, batch.positions, los, self.window, self.scale)
            return self.o_proj(o.to(q.dtype).reshape(N, -1))
        # Requests with the same number of rows (every decode token; prefill units of one size)
        # share one attention call, each over its own keys; the others run alone.
        o = q.new_empty(q.shape)
        groups: dict[int, list] = {}
        for seg in batch.segments:
            groups.setdefault(seg.span.length, []).append(seg)
        for n, segs in groups.items():
            # Keys from the first piece the window can reach (pieces anchored at absolute positions).
            los = [0 if not self.window else max(0, g.span.start - self.window + 1) // KEY_CHUNK * KEY_CHUNK
                   for g in segs]
            kv = [g.state.keys(self.layer, lo, g.span.end) for g, lo in zip(segs, los)]
            if len(segs) == 1:
                keys, values = kv[0][0][None], kv[0][1][None]
                rows = segs[0].rows
                pos = segs[0].span.positions[None]
            else:
                # One zero-padded [S, L, kvh, D] per side, L a whole number of key pieces.
                L = -(-max(kk.shape[0] for kk, _ in kv) // KEY_CHUNK) * KEY_CHUNK
                keys = kv[0][0].new_zeros(len(segs), L, self.kv_heads, self.head_dim)
                values = torch.zeros_like(keys)
                for i, (kk, vv) in enumerate(kv):
                    keys[i, :kk.shape[0]] = kk
                    values[i, :vv.shape[0]] = vv
                rows = torch.cat([torch.arange(g.rows.start, g.rows.stop, device=x.device) for g in segs])
                pos = torch.stack([g.span.positions for g in segs])
            out = attend(q[rows].view(len(segs), n, self.heads, self.head_dim), keys, values, pos,
                         torch.tensor(los, device=x.device), self.window, self.scale)
            o[rows] = out.reshape(-1, self.heads, self.head_dim)
        return self.o_proj(o.reshape(N, -1))


class DenseMLP(nn.Module):
    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up = Fused(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(silu_mul(gate, up))


class DenseLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = DenseAttention(cfg, layer)
        self.mlp = DenseMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        #: ``(key, parameter refs, dense_layer's weight arguments or None)`` of the last forward
        #: (:meth:`_weights`), so a forward does not walk the modules and their checks in every layer.
        self._cached = _Memo()

    def forward(self, x, batch, cos, sin):
        one = self._one_call(x, batch, cos, sin)
        if one is not None:
            return one
        x = x + self.self_attn(self.input_layernorm(x), batch, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _one_call(self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """The whole layer as one compiled call (``cpu_layer.cpp``'s ``dense_layer``: the modules' own
        ops in their order, the same bits) where every op of it would take its compiled path anyway
        and the attention reads the requests' buffers in place; else None (the modules run)."""
        w = self._weights(x, cos, sin)
        if w is None:
            return None
        attn = self.self_attn
        plan = _in_place_lists(batch, x.dtype, attn.window)
        if plan is None:
            return None
        ops, lanes, ln1w, ln2w, eps, qkv_w, qkv_b, qn_w, kn_w, qk_eps, o_w, o_b, gu_w, gu_b, down_w, down_b = w
        return ops.dense_layer(
            x, ln1w, ln2w, eps, lanes, qkv_w, qkv_b, qn_w, kn_w, qk_eps, cos, sin, attn.heads, attn.kv_heads,
            attn.head_dim, o_w, o_b, gu_w, gu_b, down_w, down_b, plan[0], plan[1], attn.layer, plan[2], plan[3],
            batch.positions, plan[4], attn.window, attn.scale, plan[5], plan[6])

    def _key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Everything :meth:`_checked` decides by besides this layer's parameters."""
        return (x.dtype, x.device, x.dim(), x.shape[-1], x.requires_grad, cos.dtype, cos.device, sin.dtype,
                sin.device, torch.is_grad_enabled(), invariant.paths_token(), layer_ops.paths_token())

    def _weights(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple | None:
        """:meth:`_checked`'s answer, from the last forward's where nothing it depends on changed.
        The same answer either way (tests/model/test_dense_layer_cache.py): the checks cost ~70 us a
        layer on SmolLM2 (module attribute lookups), ~2 ms of a ~30 ms decode step."""
        c = self._cached.value
        if c is not None and c[0] == self._key(x, cos, sin) and _unchanged(c[1]):
            return c[2]
        w = self._checked(x, cos, sin)
        self._cached.value = (self._key(x, cos, sin), self._refs(), w)   # after the checks: a probe or join may run
        return w

    def _refs(self) -> list[tuple]:
        """Every parameter of this layer, as :func:`_unchanged` checks it."""
        refs = []
        for m in self.modules():
            for name, t in m._parameters.items():
                if t is not None:
                    refs.append((m._parameters, name, t, t.data_ptr(), t._version))
        return refs

    def _checked(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple | None:
        """``dense_layer``'s module, lane width and weight arguments where every op of the layer takes
        its compiled path for ``x``; else None."""
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if x.dim() != 2 or mlp.down_proj.in_features % VECTOR_PAD or ln1.eps != ln2.eps:
            return None
        compiled = compiled_for(x, ln1.weight, ln2.weight, cos, sin)
        if compiled is None or not attention_serves(x, x) or x.shape[-1] % compiled[1]:
            return None
        if attn.q_norm is not None and (attn.head_dim % compiled[1] or attn.q_norm.weight.dtype != x.dtype
                                        or attn.k_norm.weight.dtype != x.dtype or attn.q_norm.eps != attn.k_norm.eps):
            return None
        qkv, gate_up = attn.qkv.joined(x), mlp.gate_up.joined(x)
        if (qkv is None or gate_up is None or not compiled_serves(x, attn.o_proj.weight)
                or not compiled_serves(x, mlp.down_proj.weight)):
            return None
        ops, lanes = compiled
        qn = attn.q_norm
        return (ops, lanes, ln1.weight, ln2.weight, ln1.eps, qkv[0], qkv[1],
                None if qn is None else qn.weight, None if qn is None else attn.k_norm.weight,
                qn.eps if qn is not None else 0.0, attn.o_proj.weight, attn.o_proj.bias, gate_up[0], gate_up[1],
                mlp.down_proj.weight, mlp.down_proj.bias)


class DenseBackbone(nn.Module):
    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DenseLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DenseLM(CausalLM):
    """A Llama / Qwen2 / Qwen3 decoder. ``tie_word_embeddings`` shares the embedding as the head;
    ``cfg.vision`` adds a vision encoder (``vision.*``, :mod:`worker.model.vision`)."""

    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.family = cfg.family
        self.model = DenseBackbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.vision = VisionEncoder(cfg.vision, cfg.hidden_size) if cfg.vision is not None else None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RopeTable(cfg, torch.float32)

    def _apply(self, fn, *args, **kwargs):
        # The rotary table follows the parameters' device and dtype (a plain tensor, not a buffer,
        # so it stays out of the state dict and the weights digest).
        out = super()._apply(fn, *args, **kwargs)
        if self.cfg.tie_word_embeddings:   # a move between devices may replace the parameter objects
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RopeTable(self.cfg, self.dtype, self.device)
        return out

    def new_state(self, block_size: int, capacity: int | None = None, *,
                  cache_dtype: str | None = None) -> DenseState:
        return DenseState(self.cfg, block_size, capacity, dtype=self.dtype, device=self.device,
                          cache_dtype=cache_dtype or self.cache_dtype, recycler=self.recycler)

    def form_layouts(self, block_size: int, cache_dtype: str | None = None) -> dict:
        return dense_form_layouts(self.cfg, block_size, self.dtype, cache_dtype or self.cache_dtype)

    def _body(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = self._embed(ids, batch)
        cos, sin = self.rope.at(batch.positions)
        for layer in self.model.layers:
            x = layer(x, batch, cos, sin)
        return x

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))


@torch.no_grad()
def build_dense(cfg: DenseConfig | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> DenseLM:
    """A dense model with seeded weights (:func:`seed_weights`), in eval mode."""
    return seed_weights(DenseLM(cfg or DenseConfig()), seed).to(dtype).eval()


@torch.no_grad()
def seed_weights(model: CausalLM, seed: int) -> CausalLM:
    """Seeded weights for a model of dense-style names (the dense and YOCO families): each tensor
    from its own generator (:mod:`worker.model.seeding`, as ``worker.model.weights.init_weights``),
    embeddings N(0, 1), norms around 1, biases small, products scaled by their fan-in; a tied head
    is the embedding."""
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        g = tensor_generator(seed, name)
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            val = torch.randn(t.shape, generator=g)
        elif "norm" in name:
            val = torch.randn(t.shape, generator=g) * 0.1 + 1.0
        elif leaf == "bias":
            val = torch.randn(t.shape, generator=g) * 0.1
        else:
            val = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
        t.copy_(val)
    return model
