"""The YOCO family's own invariants: the cross-decoder runs only where logits are wanted and
that changes no bit; any chunking of a prompt gives the same logits; reuse from cached blocks
is bit-identical at every block boundary; a resume reads only the blocks its forms' scopes
name; one global K/V per token is what the cache holds; checkpoints round-trip."""

from __future__ import annotations

import pytest
import torch

from worker.model.checkpoint import CheckpointError, load_checkpoint
from worker.model.dense import DenseConfig
from worker.model.yoco import GLOBAL_KV, SWA, YocoConfig, build_yoco
from worker.model.yoco.checkpoint import save_yoco

BS = 16
CFG = YocoConfig(sliding_window=40, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def yoco():
    return build_yoco(CFG, seed=7)


def _toks(n, seed=3):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def bits(t):
    return t.contiguous().view(torch.uint8)


def test_the_cross_decoder_runs_only_on_rows_whose_logits_are_wanted(yoco) -> None:
    toks = _toks(5 * BS + 3)
    full = yoco.prefill(toks, yoco.new_state(BS, 8 * BS), logits="all")       # cross-decoder on every row
    assert yoco.cross_rows == 3                                                # the last unit's 3 rows
    st = yoco.new_state(BS, 8 * BS)
    last = yoco.extend(toks, st, logits="last")                               # one unit, one row
    assert yoco.cross_rows == 1
    assert torch.equal(bits(last), bits(full[-1]))
    # and a unit's other rows' logits, had they been wanted, are the ones the skipped rows would give
    for cut in (1, BS, 2 * BS + 5):
        st = yoco.new_state(BS, 8 * BS)
        yoco.extend(toks[:cut], st, logits="last")
        assert torch.equal(bits(yoco.extend(toks[cut:], st, logits="last")), bits(full[-1]))


@pytest.mark.parametrize("cuts", [[BS], [4 * BS], [7, 9, 30, 1], [1] * 20, [3 * BS + 1]])
def test_any_chunking_gives_the_same_logits(yoco, cuts) -> None:
    toks = _toks(6 * BS + 2, seed=4)
    ref = yoco.prefill(toks, yoco.new_state(BS, 8 * BS), logits="all")
    st, outs, pos, k = yoco.new_state(BS, 8 * BS), [], 0, 0
    while pos < len(toks):
        n = cuts[k % len(cuts)]
        outs.append(yoco.extend(toks[pos:pos + n], st, logits="all"))
        pos, k = pos + n, k + 1
    assert torch.equal(bits(torch.cat(outs)), bits(ref))


def test_resume_at_every_block_boundary_is_bit_identical(yoco) -> None:
    toks, decode = _toks(7 * BS + 5, seed=5), [3, 250, 17, 0]
    cold = yoco.new_state(BS, 9 * BS)
    cold_logits = yoco.prefill(toks, cold, logits="all")
    blocks = [cold.export_block(i) for i in range(cold.completed_blocks)]
    cold_decode = torch.stack([yoco.decode_step(t, cold) for t in decode])
    for n in range(1, len(blocks) + 1):
        warm = yoco.new_state(BS, 9 * BS)
        warm.restore(blocks, n)
        assert torch.equal(bits(yoco.prefill(toks[n * BS:], warm, logits="all")), bits(cold_logits[n * BS:])), n
        assert torch.equal(bits(torch.stack([yoco.decode_step(t, warm) for t in decode])), bits(cold_decode)), n
        for i in range(n, len(blocks)):
            again = warm.export_block(i)
            assert all(torch.equal(bits(again[f]), bits(blocks[i][f])) for f in blocks[i]), (n, i)


def test_a_resume_reads_only_what_the_scopes_name(yoco) -> None:
    """global_kv of every block before P, swa only of the blocks overlapping [P - W + 1, P)."""
    toks = _toks(8 * BS, seed=6)
    cold = yoco.new_state(BS, 9 * BS)
    logits = yoco.prefill(toks, cold, logits="all")
    n = 6
    window_first = (n * BS - (CFG.sliding_window - 1)) // BS
    trimmed = []
    for i in range(n):
        b = cold.export_block(i)
        if i < window_first:
            b = type(b)({GLOBAL_KV: b[GLOBAL_KV]}, {GLOBAL_KV: b.specs[GLOBAL_KV]})
        trimmed.append(b)
    warm = yoco.new_state(BS, 9 * BS)
    warm.restore(trimmed, n)
    assert torch.equal(bits(yoco.prefill(toks[n * BS:], warm, logits="all")), bits(logits[n * BS:]))
    missing = [type(b)({}, {}) for b in trimmed]
    with pytest.raises(ValueError, match="lacks form 'global_kv'"):
        yoco.new_state(BS, 9 * BS).restore(missing, n)


def test_the_cache_holds_one_kv_per_token_plus_the_window(yoco) -> None:
    """Bytes per cached token: the global K/V (one per token for all cross layers), and the window
    form, which a resume needs only for its last blocks; against a standard decoder of the same
    depth, which keeps a K/V per layer per token."""
    from worker.model.dense.state import dense_form_layouts

    layouts = yoco.form_layouts(BS)
    g = layouts[GLOBAL_KV].spec
    assert g.bytes_per_block == 2 * BS * CFG.num_key_value_heads * CFG.head_dim * 4
    standard = DenseConfig(num_hidden_layers=CFG.num_hidden_layers, layer_types=("full_attention",) * 4,
                           num_attention_heads=CFG.num_attention_heads,
                           num_key_value_heads=CFG.num_key_value_heads, head_dim=CFG.head_dim)
    kv = next(iter(dense_form_layouts(standard, BS, torch.float32).values())).spec
    assert g.bytes_per_block * CFG.num_hidden_layers == kv.bytes_per_block
    assert layouts[SWA].spec.window_tokens == CFG.sliding_window - 1


def test_checkpoint_round_trip_and_refusals(yoco, tmp_path) -> None:
    d = save_yoco(yoco, tmp_path / "yoco")
    loaded = load_checkpoint(d)
    assert loaded.family == "yoco" and loaded.model.cfg.sliding_window == CFG.sliding_window
    for (k, a), b in zip(yoco.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(a, b), k
    toks = _toks(3 * BS, seed=8)
    assert torch.equal(bits(loaded.model.prefill(toks, loaded.model.new_state(BS, 4 * BS))),
                       bits(yoco.prefill(toks, yoco.new_state(BS, 4 * BS))))
    import json
    doc = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**doc, "cross_decoder_gate": True}))
    with pytest.raises(CheckpointError, match="cross_decoder_gate"):
        load_checkpoint(d)
    (d / "config.json").write_text(json.dumps({**doc, "num_key_value_heads": 3}))
    with pytest.raises(CheckpointError, match="num_key_value_heads 3 must divide"):
        load_checkpoint(d)


def test_bfloat16_and_fp8_storage_shrink_the_global_kv(yoco) -> None:
    f32 = yoco.form_layouts(BS, "float32")[GLOBAL_KV].spec.bytes_per_block
    assert yoco.form_layouts(BS, "bfloat16")[GLOBAL_KV].spec.bytes_per_block * 2 == f32
    assert yoco.form_layouts(BS, "float8_e4m3fn")[GLOBAL_KV].spec.bytes_per_block <= 0.27 * f32


def test_an_image_in_the_prompt_is_exact_across_cuts_and_resumes() -> None:
    """A YOCO config may declare the vision encoder: its vectors replace the image rows in the
    self-decoder's input; a resume after the image (its rows served from global_kv and swa) gives
    the cold run's logits bit for bit, and the image changes what follows it."""
    import numpy as np

    from worker.model.vision import PromptEmbeds, VisionConfig, encode_images, image_spec

    img = 255
    vlm = build_yoco(YocoConfig(sliding_window=40, vision=VisionConfig(), image_token_id=img), seed=9)
    assert image_spec(vlm).image_token_id == img
    pixels = np.random.default_rng(4).integers(0, 256, (32, 32, 3), dtype=np.uint8).tobytes()
    (v,) = encode_images(vlm, [pixels])
    toks = _toks(20, seed=10) + [img] * v.shape[0] + _toks(40, seed=11)
    embeds = PromptEmbeds([(20, v)])
    cold = vlm.new_state(BS, 6 * BS)
    logits = vlm.prefill(toks, cold, embeds=embeds, logits="all")
    assert not torch.equal(logits[20:], vlm.prefill(toks, vlm.new_state(BS, 6 * BS), logits="all")[20:])
    blocks = [cold.export_block(i) for i in range(cold.completed_blocks)]
    for n in (1, 2, 3, 4):     # before, inside (20..36 spans blocks 1 and 2) and after the image
        warm = vlm.new_state(BS, 6 * BS)
        warm.restore(blocks, n)
        rest = PromptEmbeds([(20, v)]) if n * BS < 36 else None
        assert torch.equal(bits(vlm.prefill(toks[n * BS:], warm, embeds=rest, logits="all")), bits(logits[n * BS:])), n
