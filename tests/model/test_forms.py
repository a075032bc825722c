"""The form catalogue the model declares, and rejection of state saved under another spec."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shared.forms import FormScope, FormSpecMismatch
from worker.model import ConfigError, ModelConfig, RequestState, declare_forms
from worker.model.forms import form_layouts
from worker.model.state import BlockPayload

BLOCK = 16
F32 = 4


def test_tiny_catalogue_bytes_and_scopes(tiny_cfg) -> None:
    cat = declare_forms(tiny_cfg, BLOCK)
    assert cat.model_id == tiny_cfg.model_id and cat.block_size == BLOCK
    assert cat.names == ("compressed", "indexer", "tail", "swa")
    by = {f.name: f for f in cat.forms}
    # compressed: CSA layers 2, 4 emit 16/4 entries, HCA layers 3, 5 emit 16/16, each 64 wide.
    assert by["compressed"].bytes_per_block == (4 + 1 + 4 + 1) * 64 * F32 == 2560
    # indexer: 2 CSA layers x 4 keys x 32 dims.
    assert by["indexer"].bytes_per_block == 2 * 4 * 32 * F32 == 1024
    # tail: 2 CSA layers x (kv, score) x 4 halo rows x (64 main + 32 indexer).
    assert by["tail"].bytes_per_block == 2 * 2 * 4 * 96 * F32 == 6144
    # swa: 6 layers x 16 rows x 64.
    assert by["swa"].bytes_per_block == 6 * 16 * 64 * F32 == 24576
    assert [by[n].scope for n in cat.names] == [FormScope.FULL_HISTORY, FormScope.FULL_HISTORY,
                                                FormScope.RESUME_POINT, FormScope.WINDOW]
    assert by["swa"].window_tokens == 31 and cat.window_blocks(by["swa"]) == 2
    assert all(f.dtype == "float32" and f.layout_version == 1 for f in cat.forms)


def test_all_sliding_window_config_declares_swa_only() -> None:
    cfg = ModelConfig(compress_ratios=(0,) * 6)
    cat = declare_forms(cfg, 8)
    assert cat.names == ("swa",)
    assert cat.forms[0].bytes_per_block == 6 * 8 * 64 * F32
    state = RequestState(cfg, 8, capacity=64)
    assert state.layouts.keys() == {"swa"}


def test_hca_only_config_declares_no_tail_or_indexer() -> None:
    cfg = ModelConfig(compress_ratios=(0, 16, 0, 16, 0, 16))
    assert declare_forms(cfg, 16).names == ("compressed", "swa")


def test_payloads_have_declared_shapes_and_bytes(tiny_cfg, cold_run) -> None:
    layouts = form_layouts(tiny_cfg, BLOCK)
    for block in cold_run[1]:
        assert block.keys() == layouts.keys()
        for name, t in block.items():
            assert tuple(t.shape) == layouts[name].shape and t.dtype == torch.float32
            assert t.numel() * t.element_size() == layouts[name].spec.bytes_per_block
            assert block.specs[name] == layouts[name].spec


def test_spec_digest_changes_with_ratio_width_and_window(tiny_cfg) -> None:
    base = {f.name: f.spec_digest for f in declare_forms(tiny_cfg, BLOCK).forms}
    other_ratio = {f.name: f.spec_digest for f in declare_forms(tiny_cfg.replace(compress_ratios=(0, 0, 4, 8, 4, 8)),
                                                                BLOCK).forms}
    assert other_ratio["compressed"] != base["compressed"] and other_ratio["swa"] != base["swa"]
    assert other_ratio["indexer"] == base["indexer"]          # CSA layers unchanged
    wider = {f.name: f.spec_digest for f in declare_forms(tiny_cfg.replace(index_head_dim=48), BLOCK).forms}
    assert wider["indexer"] != base["indexer"] and wider["tail"] != base["tail"]
    assert wider["compressed"] == base["compressed"]
    window = {f.name: f.spec_digest for f in declare_forms(tiny_cfg.replace(sliding_window=64), BLOCK).forms}
    assert window["swa"] != base["swa"]


def test_block_size_must_be_a_multiple_of_every_ratio(tiny_cfg) -> None:
    with pytest.raises(ConfigError, match=r"block_size 8 must be a multiple .* not a multiple of \[16\]"):
        declare_forms(tiny_cfg, 8)
    with pytest.raises(ConfigError, match="block_size 24"):
        RequestState(tiny_cfg, 24)


# ---- state saved under one spec, read under another --------------------------------------

def test_other_ratio_is_rejected(tiny_cfg, cold_run) -> None:
    other = RequestState(tiny_cfg.replace(compress_ratios=(0, 0, 4, 8, 4, 8)), BLOCK, capacity=256)
    with pytest.raises(FormSpecMismatch, match=r"form 'compressed'.*ratios 4,16,4,16 \(stored\) != 4,8,4,8"):
        other.restore(cold_run[1], 4)


def test_other_width_is_rejected(tiny_cfg, cold_run) -> None:
    other = RequestState(tiny_cfg.replace(head_dim=32), BLOCK, capacity=256)
    with pytest.raises(FormSpecMismatch, match=r"width 64 \(stored\) != 32"):
        other.restore(cold_run[1], 4)


def _retag(blocks, form, **changes):
    out = []
    for b in blocks:
        specs = dict(b.specs)
        specs[form] = msgspec.structs.replace(specs[form], **changes)
        data = dict(b)
        if "dtype" in changes:
            data[form] = b[form].to(getattr(torch, changes["dtype"]))
        out.append(BlockPayload(data, specs))
    return out


def test_other_dtype_is_rejected(tiny_cfg, cold_run) -> None:
    blocks = _retag(cold_run[1], "swa", dtype="bfloat16")
    with pytest.raises(FormSpecMismatch, match=r"form 'swa'.*dtype bfloat16 \(stored\) != float32"):
        RequestState(tiny_cfg, BLOCK, capacity=256).restore(blocks, 4)


def test_other_layout_version_is_rejected(tiny_cfg, cold_run) -> None:
    blocks = _retag(cold_run[1], "tail", layout_version=2)
    with pytest.raises(FormSpecMismatch, match=r"form 'tail'.*layout_version 2 \(stored\) != 1"):
        RequestState(tiny_cfg, BLOCK, capacity=256).restore(blocks, 4)


def test_payload_without_spec_or_with_wrong_shape_is_rejected(tiny_cfg, cold_run) -> None:
    state = RequestState(tiny_cfg, BLOCK, capacity=256)
    with pytest.raises(ValueError, match="carries no form spec"):
        state.restore([dict(b) for b in cold_run[1]], 4)
    # Plain dicts are accepted with explicit specs.
    specs = cold_run[1][0].specs
    state.restore([dict(b) for b in cold_run[1]], 4, specs=specs)
    assert state.pos == 64
    bad = [BlockPayload({**b, "indexer": b["indexer"][:-1]}, b.specs) for b in cold_run[1]]
    with pytest.raises(ValueError, match="form 'indexer' has shape"):
        state.restore(bad, 4)
