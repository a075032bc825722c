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

from collections.abc import Sequence

import torch
from torch import nn

from kernels.invariant import invariant_here, probe
from worker.model.attention import Attention
from worker.model.config import ModelConfig
from worker.model.hyper_connections import HyperConnection, HyperHead
from worker.model.linear import Linear
from worker.model.moe import MoE
from worker.model.norms import RMSNorm
from worker.model.rope import RopeTables
from worker.model.state import Batch, RequestState, Segment


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


class HybridAttentionLM(nn.Module):
    """The language model. Build initialised weights with :func:`worker.model.weights.build_model`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RopeTables(cfg, cfg.max_position_embeddings)
        #: Whether fused forwards and decode-made blocks are exact here (``kernels.invariant.probe``;
        #: the worker sets it from the probe at start). False: one request per forward, and only
        #: blocks of block-aligned units are exportable.
        self.batch_invariant = True

    def _apply(self, fn, *args, **kwargs):
        # Keep the rotary tables on the parameters' device (they are plain tensors, not
        # buffers, so they stay out of the state dict and the weights digest).
        out = super()._apply(fn, *args, **kwargs)
        self.rope = RopeTables(self.cfg, self.cfg.max_position_embeddings, device=self.lm_head.weight.device)
        return out

    def check_invariance(self) -> list[str]:
        """Probe this machine's products at this model's shapes (``kernels.invariant.probe``);
        sets :attr:`batch_invariant` and returns what failed (empty: invariant)."""
        shapes = {(m.in_features, m.out_features) for m in self.modules() if isinstance(m, nn.Linear)}
        cfg = self.cfg
        shapes |= {(cfg.hidden_size, 2 * cfg.moe_intermediate_size), (cfg.moe_intermediate_size, cfg.hidden_size),
                   (cfg.hidden_size, cfg.n_routed_experts), (cfg.hc_mult * cfg.hidden_size, cfg.hc_mult),
                   (cfg.hc_mult * cfg.hidden_size, (2 + cfg.hc_mult) * cfg.hc_mult)}
        if self.lm_head.weight.device.type != "cpu":
            # NOTE: the rules are measured for the CPU path only; cuBLAS and the Triton kernels
            # (fixed tiles, but not yet checked row against batch) run one request per forward.
            failures = [("batch invariance is established for the CPU path only, not for "
                         f"{self.lm_head.weight.device.type}")]
        else:
            failures = probe(shapes)
        self.batch_invariant = not failures
        return failures

    def new_state(self, block_size: int, capacity: int | None = None) -> RequestState:
        """A fresh per-request state on this model's device."""
        return RequestState(self.cfg, block_size, capacity, device=self.lm_head.weight.device)

    def check_step(self, tokens: torch.Tensor | Sequence[int], state: RequestState) -> None:
        """Raise ``ValueError`` if ``tokens`` cannot run on ``state`` (ids outside the vocabulary,
        no tokens, past the state's capacity) — without touching the state: the step loop
        checks every request this way before a fused forward, so one bad request fails alone."""
        state.span(self._ids(tokens).numel())

    def _ids(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Token ids as a 1-D int64 tensor on the model's device; ``ValueError`` outside the vocabulary."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.lm_head.weight.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        return ids

    @torch.no_grad()
    def forward_batch(self, work: Sequence[tuple[torch.Tensor | Sequence[int], RequestState]], *,
                      logits: str = "last") -> list[torch.Tensor]:
        """Run several requests' next tokens as ONE forward and advance each state.

        ``work`` is ``(tokens, state)`` per request (distinct states; any lengths: a decode
        token, a prefill unit). Every op is batch-invariant (``kernels.invariant``), so each
        request's rows come out bit-identical to running it alone. Returns, per request, logits
        ``[T, vocab]`` (``logits="all"``) or ``[vocab]`` of its last token (``"last"``).
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits={logits!r}: use 'all' or 'last'")
        if not work:
            return []
        if len({id(st) for _, st in work}) != len(work):
            raise ValueError("forward_batch: each request state may appear once per forward")
        invariant = self.batch_invariant and invariant_here()
        if len(work) > 1 and not invariant:
            raise RuntimeError("this model's ops are not batch-invariant on this machine "
                               "(kernels.invariant.probe failed, or torch runs more than one intra-op thread): "
                               "run requests one at a time")
        dev = self.lm_head.weight.device
        ids_list = [self._ids(tokens) for tokens, _ in work]
        segs, row = [], 0
        for ids, (_, state) in zip(ids_list, work):
            span = state.span(ids.numel())
            segs.append(Segment(state, span, slice(row, row + span.length)))
            row += span.length
        batch = Batch(tuple(segs), torch.cat([g.span.positions for g in segs]) if len(segs) > 1
                      else segs[0].span.positions)
        ids = torch.cat(ids_list) if len(ids_list) > 1 else ids_list[0]
        x = self.model.embed_tokens(ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, ids, batch, self.rope)
        for g in segs:
            g.state.commit(g.span, invariant=invariant)
        if logits == "last":
            streams = streams[torch.tensor([g.rows.stop - 1 for g in segs], device=dev)]
        out = self.lm_head(self.model.norm(self.model.hc_head(streams)))
        if logits == "last":
            return list(out.unbind(0))
        return [out[g.rows] for g in segs]

    def extend(self, tokens: torch.Tensor | Sequence[int], state: RequestState, *,
               logits: str = "all") -> torch.Tensor:
        """Run ``tokens`` as ONE unit at the state's position and advance the state.

        Any length is valid (tests use it for arbitrary chunkings). Returns logits
        ``[T, vocab]`` (``logits="all"``) or ``[vocab]`` for the last token (``"last"``).
        """
        return self.forward_batch([(tokens, state)], logits=logits)[0]

    def prefill(self, tokens: torch.Tensor | Sequence[int], state: RequestState, *, chunk_blocks: int = 1,
                logits: str = "all") -> torch.Tensor:
        """Prefill ``tokens`` from the state's position (a block boundary) in grid-anchored units.

        See the module docstring for the exactness rule this schedule enforces.
        """
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        bs = state.block_size
        if state.pos % bs:
            raise ValueError(f"prefill must start on a block boundary; the state is at {state.pos} "
                             f"(block size {bs}) — continue with decode_step or extend")
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        unit = chunk_blocks * bs
        start, end = state.pos, state.pos + ids.numel()
        full_end = end - end % bs
        outs = []
        s = start
        while s < full_end:
            e = min((s // unit + 1) * unit, full_end)      # next grid point, or the last full block
            outs.append(self.extend(ids[s - start:e - start], state, logits=logits))
            s = e
        if s < end:
            # NOTE: the trailing partial block is a unit of its own and is never exportable.
            outs.append(self.extend(ids[s - start:], state, logits=logits))
        if logits == "last":
            return outs[-1]
        return torch.cat(outs, 0)

    def decode_step(self, token: int | torch.Tensor, state: RequestState) -> torch.Tensor:
        """One token at the state's position; returns its logits ``[vocab]``."""
        return self.extend([int(token)], state, logits="last")
