"""Seeded initialisation, safetensors round trip in HF naming, checkpoint errors, digest."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.model import ModelConfig, build_model, load_safetensors, save_safetensors, weights_digest
from worker.model.weights import WeightsError

#: Digest of the tiny default config at seed 0 (torch 2.13 CPU RNG). A change means the
#: seeded weights changed, and every cached block of the old namespace is stale.
TINY_SEED0_DIGEST = "1876530b0bd1fb16a1148b11e877036d"


def test_init_is_deterministic_and_seed_dependent(tiny) -> None:
    again = build_model(ModelConfig(), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(tiny.state_dict().values(), again.state_dict().values()))
    assert weights_digest(again) == weights_digest(tiny)
    other = build_model(ModelConfig(), seed=1)
    assert weights_digest(other) != weights_digest(tiny)


def test_digest_is_pinned_for_the_tiny_default(tiny) -> None:
    d = weights_digest(tiny)
    assert d == TINY_SEED0_DIGEST


def test_digest_sees_every_byte_and_name(tiny) -> None:
    m = build_model(ModelConfig(), seed=0)
    base = weights_digest(m)
    with torch.no_grad():
        m.model.layers[3].self_attn.sinks[1] += 1e-7
    assert weights_digest(m) != base
    with torch.no_grad():
        m.model.layers[3].self_attn.sinks[1] -= 1e-7
        m.model.layers[0].mlp.gate.tid2eid[5, 0] ^= 1
    assert weights_digest(m) != base


def test_tensor_init_does_not_depend_on_other_tensors() -> None:
    """Each tensor has its own generator: a different layer count leaves layer 0 alone."""
    a = build_model(ModelConfig(), seed=3)
    b = build_model(ModelConfig(num_hidden_layers=2, compress_ratios=(0, 0), mlp_layer_types=("hash_moe", "moe")),
                    seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert torch.equal(sa["model.layers.0.self_attn.q_a_proj.weight"], sb["model.layers.0.self_attn.q_a_proj.weight"])
    assert torch.equal(sa["model.embed_tokens.weight"], sb["model.embed_tokens.weight"])


def test_safetensors_round_trip(tiny, tmp_path, tokens) -> None:
    path = tmp_path / "model.safetensors"
    save_safetensors(tiny, path)
    names = set(load_file(str(path)))
    assert "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight" in names
    assert "model.layers.0.mlp.gate.tid2eid" in names and "model.hc_head.hc_fn" in names
    other = build_model(ModelConfig(), seed=99)
    load_safetensors(other, path)
    assert weights_digest(other) == weights_digest(tiny)
    s1, s2 = tiny.new_state(16), other.new_state(16)
    assert torch.equal(tiny.prefill(tokens[:40], s1), other.prefill(tokens[:40], s2))


def test_sharded_directory_and_ignored_mtp_tensors(tiny, tmp_path) -> None:
    sd = {k: v.contiguous() for k, v in tiny.state_dict().items()}
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:50]}, str(tmp_path / "a.safetensors"))
    save_file({k: sd[k] for k in keys[50:]} | {"mtp.0.ffn.w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    other = load_safetensors(build_model(ModelConfig(), seed=5), tmp_path)
    assert weights_digest(other) == weights_digest(tiny)


def _write_modified(tiny, path, edit):
    sd = {k: v.clone().contiguous() for k, v in tiny.state_dict().items()}
    edit(sd)
    save_file(sd, str(path))
    return path


def test_missing_tensor_is_named(tiny, tmp_path) -> None:
    p = _write_modified(tiny, tmp_path / "m.safetensors", lambda sd: sd.pop("model.layers.4.self_attn.sinks"))
    with pytest.raises(WeightsError, match=r"missing \['model.layers.4.self_attn.sinks'\]"):
        load_safetensors(build_model(), p)


def test_extra_tensor_is_named(tiny, tmp_path) -> None:
    p = _write_modified(tiny, tmp_path / "e.safetensors", lambda sd: sd.update({"model.layers.9.x": torch.ones(1)}))
    with pytest.raises(WeightsError, match=r"unexpected \['model.layers.9.x'\]"):
        load_safetensors(build_model(), p)


def test_misshaped_tensor_is_named(tiny, tmp_path) -> None:
    def edit(sd):
        sd["model.layers.3.self_attn.compressor.position_bias"] = torch.zeros(8, 64)
    p = _write_modified(tiny, tmp_path / "s.safetensors", edit)
    with pytest.raises(WeightsError, match=r"compressor.position_bias: shape \(8, 64\) .* needs \(16, 64\)"):
        load_safetensors(build_model(), p)


def test_integer_table_must_stay_integer(tiny, tmp_path) -> None:
    def edit(sd):
        sd["model.layers.0.mlp.gate.tid2eid"] = sd["model.layers.0.mlp.gate.tid2eid"].float()
    p = _write_modified(tiny, tmp_path / "d.safetensors", edit)
    with pytest.raises(WeightsError, match="tid2eid: dtype torch.float32"):
        load_safetensors(build_model(), p)


def test_damaged_or_absent_file(tmp_path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        load_safetensors(build_model(), bad)
    with pytest.raises(WeightsError, match="no such file"):
        load_safetensors(build_model(), tmp_path / "absent.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match="no \\*.safetensors files"):
        load_safetensors(build_model(), empty)
