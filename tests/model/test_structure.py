"""Structural invariants of the cache state, checked against a naive re-derivation.

Independent of the HF oracle: compressed entries are recomputed window by window from the
layer's attention input with the formulas of research note §2 (per-channel softmax over the
window's slots, CSA a-halves of the previous window + b-halves of the current one, RMSNorm,
RoPE at the window's first position), and compared with what the state holds.
"""

from __future__ import annotations

import torch

from kernels.rope import apply_rope
from worker.model.state import IDX, MAIN

BLOCK = 16


def naive_entry(comp, x: torch.Tensor, w: int, rope) -> torch.Tensor:
    m, d = comp.ratio, comp.width
    kv = comp.kv_proj(x)
    score = comp.gate_proj(x) + comp.position_bias[torch.arange(x.shape[0]) % m]
    cur = range(w * m, (w + 1) * m)
    if comp.overlap:
        rows_kv = [kv[j, d:] for j in cur]
        rows_sc = [score[j, d:] for j in cur]
        if w > 0:
            prev = range((w - 1) * m, w * m)
            rows_kv = [kv[j, :d] for j in prev] + rows_kv
            rows_sc = [score[j, :d] for j in prev] + rows_sc
    else:
        rows_kv = [kv[j] for j in cur]
        rows_sc = [score[j] for j in cur]
    weights = torch.softmax(torch.stack(rows_sc), dim=0)
    pooled = (weights * torch.stack(rows_kv)).sum(0)
    normed = comp.kv_norm(pooled)
    cos, sin = rope.at("compress", torch.tensor([w * m]))
    return apply_rope(normed[None], cos, sin)[0]


def test_entries_match_naive_derivation(tiny, tokens) -> None:
    inputs = {}
    hooks = [layer.self_attn.register_forward_hook(
        lambda mod, args, out, i=i: inputs.setdefault(i, []).append(args[0].clone()))
        for i, layer in enumerate(tiny.model.layers)]
    try:
        state = tiny.new_state(BLOCK)
        tiny.prefill(tokens[:96], state)
    finally:
        for h in hooks:
            h.remove()
    P = state.pos
    with torch.no_grad():
        for layer in tiny.cfg.compressed_layers:
            attn = tiny.model.layers[layer].self_attn
            x = torch.cat(inputs[layer])                       # attention input of positions [0, P)
            m = attn.ratio
            slots = [(attn.compressor, state.compressor(layer, MAIN))]
            if attn.compressor.overlap:
                slots.append((attn.compressor.indexer, state.compressor(layer, IDX)))
            for comp, slot in slots:
                held = slot.entries(P // m)
                assert held.shape[0] == P // m                 # one entry per closed window
                for w in range(P // m):
                    want = naive_entry(comp, x, w, tiny.rope)
                    assert torch.allclose(held[w], want, atol=1e-5, rtol=1e-5), (layer, w)


def test_indexer_picks_are_visible_and_distinct(tiny, tokens) -> None:
    picks = []
    layer = tiny.cfg.csa_layers[0]
    indexer = tiny.model.layers[layer].self_attn.compressor.indexer
    orig = indexer.select

    def spy(parts):
        out = orig(parts)
        picks.append((torch.cat([p[3] for p in parts]).clone(), out.clone()))
        return out

    indexer.select = spy
    try:
        tiny.prefill(tokens, tiny.new_state(BLOCK))
    finally:
        del indexer.select
    assert picks, "the indexer was never asked to pick"
    m, k = tiny.cfg.csa_ratio, tiny.cfg.index_topk
    for positions, sel in picks:
        for t, row in zip(positions.tolist(), sel.tolist()):
            visible = (t + 1) // m
            valid = [i for i in row if i >= 0]
            assert len(valid) == min(k, visible) and len(set(valid)) == len(valid)
            assert all(i < visible for i in valid)
