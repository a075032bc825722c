"""The capacity planner: bytes per token per form against the research note's figures, the
worker's own form declaration and pool split, and the concurrency × context arithmetic."""

from __future__ import annotations

import argparse
import json

import pytest

from kvledger.cli import main
from kvledger.plan import (
    GiB, PlanError, Plan, build_plan, default_block_size, entry_bytes, form_plans, index_key_bytes, load_model_config,
)
from shared.config import parse_config
from worker.model.forms import declare_forms, form_layouts
from worker.settings import pool_slots


def args(**kw) -> argparse.Namespace:
    base = dict(model=None, model_dir=None, dtype=None, state_dtype="float32", block_size=None, memory=None,
                weights=None, reserve=None, context=None, concurrency=None)
    return argparse.Namespace(**{**base, **kw})


def growth(preset: str, dtype: str) -> float:
    model = load_model_config(preset, None)
    forms = form_plans(model, default_block_size(model, 16), dtype)
    bs = default_block_size(model, 16)
    return sum(f.bytes_per_token(bs) for f in forms if f.scope == "full_history")


def test_research_note_figures() -> None:
    # §4.3: Pro 30 CSA + 31 HCA at bf16 = 30·320 + 31·8 = 9848 B/token (9.62 GiB at 1M tokens).
    assert growth("dsv4-pro", "bfloat16") == 9848
    assert growth("dsv4-pro", "bfloat16") * 2**20 / GiB == pytest.approx(9.62, abs=0.005)
    # Flash 21 CSA + 20 HCA: 6880 B/token bf16, ≈3850 B/token fp8 (584 B entries, 132 B indexer keys).
    assert growth("dsv4-flash", "bfloat16") == 6880
    assert growth("dsv4-flash", "fp8") == pytest.approx(3850, abs=0.5)
    assert entry_bytes(512, "fp8", 64) == 584 and index_key_bytes(128, "fp8") == 132
    assert entry_bytes(512, "bfloat16", 64) == 1024 and index_key_bytes(128, "bfloat16") == 256


def test_presets_follow_the_layer_schedule() -> None:
    flash, pro = load_model_config("dsv4-flash", None), load_model_config("dsv4-pro", None)
    assert (len(flash.csa_layers), len(flash.hca_layers), flash.compress_ratios.count(0)) == (21, 20, 2)
    assert (len(pro.csa_layers), len(pro.hca_layers), pro.compress_ratios.count(0)) == (30, 31, 0)
    assert default_block_size(pro, 16) == 128 and default_block_size(load_model_config("tiny", None), 16) == 16


def test_float32_is_exactly_what_the_worker_allocates() -> None:
    """At float32 the planner's blocks are the worker's declared bytes, and its slots the worker's split."""
    model = load_model_config("tiny", None)
    for bs in (16, 32, 64):
        plans = {f.name: f for f in form_plans(model, bs, "float32")}
        layouts = form_layouts(model, bs)
        assert list(plans) == list(layouts)
        assert {n: p.bytes_per_block for n, p in plans.items()} == \
            {n: lay.spec.bytes_per_block for n, lay in layouts.items()}
    cfg = parse_config({"worker": {"pool_bytes": 48 * 2**20}, "service": {"cache_reserve_ratio": 0.6},
                        "cache": {"compressed_pool_limit": 0.6, "swa_pool_limit": 0.2, "tail_pool_limit": 0.15}})
    plan = build_plan(args(), cfg)
    assert plan.slots() == pool_slots(declare_forms(model, 16), cfg)
    # the tiny model's note §6.2 figure: 224 B/token of full history at fp32
    assert plan.growth_bytes_per_token == 224


def test_capacity_arithmetic() -> None:
    cfg = parse_config({})
    plan = build_plan(args(model="dsv4-pro", memory=141, weights=80, context=[4096, 131072, 1048576]), cfg)
    assert plan.cache_budget_bytes == pytest.approx((141 - 80) * GiB * 0.7)
    bounded = plan.bounded_bytes_per_request()
    assert plan.bytes_per_request(1048576) == 9848 * 1048576 + bounded
    counts = [plan.max_concurrency(c)[0] for c in plan.contexts]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1
    slots = plan.slots()
    n, form = plan.max_concurrency(131072)
    assert form == "compressed" and n == slots["compressed"] // (131072 // 128)
    for c in (1, 8, 32, 200):
        longest, _ = plan.max_context(c)
        assert longest % plan.block_size == 0
        assert plan.max_concurrency(longest)[0] >= c
        assert longest == plan.max_position or plan.max_concurrency(longest + plan.block_size)[0] < c
    # more memory never means fewer requests
    bigger = build_plan(args(model="dsv4-pro", memory=282, weights=80, context=[131072]), cfg)
    assert bigger.max_concurrency(131072)[0] > n


def test_errors_name_what_is_allowed() -> None:
    cfg = parse_config({})
    with pytest.raises(PlanError, match="--weights GiB is needed"):
        build_plan(args(model="dsv4-flash", memory=80), cfg)
    with pytest.raises(PlanError, match=r"multiple of every nonzero compress ratio.*\[128\]"):
        build_plan(args(model="dsv4-pro", block_size=64), cfg)
    with pytest.raises(PlanError, match="leaves nothing after the weights"):
        build_plan(args(model="dsv4-pro", memory=40, weights=80), cfg)
    with pytest.raises(PlanError, match="no config.json"):
        build_plan(args(model_dir="/nonexistent"), cfg)


def test_plan_command(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["plan", "--model", "dsv4-pro", "--json", "--context", "1048576"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["growth_bytes_per_token"] == 9848 and doc["block_size"] == 128 and doc["dtype"] == "bfloat16"
    assert [c["context"] for c in doc["capacity"]] == [1048576]

    assert main(["plan"]) == 0  # the tiny model at the config's pool_bytes: a table for people
    out = capsys.readouterr().out
    assert "224.00 B/token" in out and "concurrency × context length" in out and "swa" in out

    # --model-dir with config.json (ModelConfig fields) and safetensors: weights from the files
    (tmp_path / "config.json").write_text(json.dumps({"model_id": "mine", "sliding_window": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 2**20)
    assert main(["plan", "--model-dir", str(tmp_path), "--memory", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model_id"] == "mine" and "weights 1.00 MiB" in doc["budget"]

    assert main(["plan", "--model", "dsv4-flash", "--memory", "80"]) == 2
    assert capsys.readouterr().err.startswith("kvledger plan: --weights GiB is needed")


def test_plan_type_is_plain_data() -> None:
    plan = build_plan(args(), parse_config({}))
    assert isinstance(plan, Plan) and json.dumps(plan.to_dict())


def test_standard_models_plan_layers_times_kv_heads_times_head_dim_times_dtype() -> None:
    model = load_model_config("llama-3.1-8b", None)
    (kv,) = form_plans(model, 16, "bfloat16")
    assert kv.name == "kv" and kv.scope == "full_history"
    assert kv.bytes_per_token(16) == 32 * 2 * 8 * 128 * 2          # 128 KiB per token, the published figure
    assert form_plans(load_model_config("qwen2.5-7b", None), 16, "float16")[0].bytes_per_token(16) == 28 * 2 * 4 * 128 * 2
    with pytest.raises(PlanError, match="fp8"):
        form_plans(model, 16, "fp8")


def test_plan_reads_a_save_pretrained_directory_and_gives_a_dense_model_the_whole_budget(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tests.checkpoints import save_hf
    import torch
    d = save_hf("qwen2", tmp_path / "q", dtype=torch.bfloat16)
    model = load_model_config(None, str(d))
    assert model.family == "qwen2" and default_block_size(model, 16) == 16
    cfg = parse_config({})
    args = argparse.Namespace(model=None, model_dir=str(d), dtype=None, state_dtype="float32", block_size=None,
                              memory=None, weights=None, reserve=None, context=[256], concurrency=None)
    plan = build_plan(args, cfg)
    assert plan.dtype == "bfloat16"                              # the checkpoint's own dtype
    (kv,) = plan.forms
    c = cfg.cache
    share = c.compressed_pool_limit + c.swa_pool_limit + c.tail_pool_limit
    assert plan.slots()["kv"] == int(plan.cache_budget_bytes * share // kv.bytes_per_block)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_cache_dtype_plans_what_the_worker_allocates(preset, cache_dtype) -> None:
    """--cache-dtype plans each form with the worker's own layout at that ``cache.dtype``: the
    pool slot sizes a worker allocates, and the slots a budget holds (fp8 ≈ 0.26 of float32)."""
    cfg = parse_config({})
    plan = build_plan(args(model=preset, cache_dtype=cache_dtype), cfg)
    f32 = build_plan(args(model=preset, cache_dtype="float32"), cfg)
    model = load_model_config(preset, None)
    if preset == "tiny":
        want = {n: lay.spec.bytes_per_block for n, lay in form_layouts(model, plan.block_size, cache_dtype).items()}
    else:
        import torch

        from worker.model.dense.state import dense_form_layouts
        want = {n: lay.spec.bytes_per_block
                for n, lay in dense_form_layouts(model, plan.block_size, torch.float32, cache_dtype).items()}
    assert {f.name: f.bytes_per_block for f in plan.forms} == want
    assert all(f.dtype == cache_dtype for f in plan.forms)
    ratio = 0.5 if cache_dtype == "bfloat16" else 0.27
    for f, g in zip(plan.forms, f32.forms):
        assert f.bytes_per_block <= ratio * g.bytes_per_block
    assert sum(plan.slots().values()) > sum(f32.slots().values())
    with pytest.raises(PlanError, match="--cache-dtype 'int4'"):
        build_plan(args(model=preset, cache_dtype="int4"), cfg)
