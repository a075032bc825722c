"""Parity with Hugging Face ``DeepseekV4ForCausalLM`` (transformers 5.23, CPU, fp32).

Both models hold the same seeded weights, including the tensors HF initialises to zero
(sinks, compressor position biases, mHC bases, router correction bias), which our init
perturbs so that their paths are compared too. The 200-token prompt closes 50 CSA windows
(the indexer picks 4 of up to 50) and 12 HCA windows, and crosses the 32-token window.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from worker.model.hf_compat import to_hf_model  # noqa: E402
from worker.model.rope import RopeTables  # noqa: E402

TOL = 1e-4
BLOCK = 16


@pytest.fixture(scope="module")
def hf(tiny):
    return to_hf_model(tiny)


def test_zero_initialised_tensors_are_perturbed(tiny) -> None:
    sd = tiny.state_dict()
    for suffix in ("self_attn.sinks", "compressor.position_bias", "indexer.position_bias", "attn_hc.base",
                   "ffn_hc.base", "hc_head.hc_base", "gate.e_score_correction_bias"):
        hits = [k for k in sd if k.endswith(suffix)]
        assert hits, suffix
        assert all(sd[k].abs().min() > 0 for k in hits), suffix
    tid2eid = sd["model.layers.0.mlp.gate.tid2eid"]
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all() and tid2eid.unique().numel() == tiny.cfg.n_routed_experts


def test_rotary_tables_match_hf(tiny, hf) -> None:
    rot = hf.model.rotary_emb
    ours = RopeTables(tiny.cfg, 8)
    assert torch.equal(ours.inv_freq["main"], rot.main_inv_freq)
    assert torch.equal(ours.inv_freq["compress"], rot.compress_inv_freq)   # YaRN, truncated ramp


def test_prefill_logits_match_hf(tiny, hf, tokens, cold_run) -> None:
    with torch.no_grad():
        ref = hf(tokens[None], use_cache=False).logits[0]
    ours, _ = cold_run
    assert ref.shape == ours.shape
    assert (ours - ref).abs().max().item() < TOL


def test_incremental_decode_logits_match_hf(tiny, hf, tokens) -> None:
    """HF with its cache: prefill 150 tokens, then 20 one at a time (crossing CSA and HCA
    boundaries at 152..168 and 160); ours likewise (block units, a trailing partial block,
    then decode steps)."""
    split, stop = 150, 170
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = [hf(tokens[None, :split], past_key_values=cache, use_cache=True).logits[0]]
        for i in range(split, stop):
            ref.append(hf(tokens[None, i:i + 1], past_key_values=cache, use_cache=True).logits[0])
    state = tiny.new_state(BLOCK)
    ours = [tiny.prefill(tokens[:split], state)] + [tiny.decode_step(t, state)[None] for t in tokens[split:stop]]
    assert (torch.cat(ours) - torch.cat(ref)).abs().max().item() < TOL


def test_chunked_hf_prefill_matches_our_block_prefill(tiny, hf, tokens, cold_run) -> None:
    """HF fed in uneven chunks through its cache agrees with our block-aligned prefill."""
    cache = DynamicCache(config=hf.config)
    ref, s = [], 0
    with torch.no_grad():
        for n in (37, 16, 51, 3, 93):
            ref.append(hf(tokens[None, s:s + n], past_key_values=cache, use_cache=True).logits[0])
            s += n
    assert s == len(tokens)
    assert (torch.cat(ref) - cold_run[0]).abs().max().item() < TOL
