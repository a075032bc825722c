"""Low-precision cache storage (``cache.dtype``): exact reuse at every precision, every family.

The rule (``worker.model.storage``): a warm run equals a cold run whose own cached state went
through the same storage precision. Each case below runs a cold prefill + decode with the
storage precision set, exports every block, then resumes a fresh state from the first ``n``
blocks' payloads (for every ``n``) and requires the rest — prefill logits, decode logits and
the blocks it exports again — bit-identical to the cold run. Plus: blocks completed by decode
steps equal the prefill's, a request's logits are the same alone or batched, and what the
precision costs in bytes.
"""

from __future__ import annotations

import pytest
import torch

from shared.forms import FormScope
from worker.model import build_model
from worker.model.dense import DenseConfig, build_dense
from worker.model.storage import CACHE_DTYPES, Storage, StorageError

BS = 16
STORED = ("bfloat16", "float16", "float8_e4m3fn")


def _hybrid(dtype):
    return build_model(seed=3).to(dtype)


def _dense(dtype):
    cfg = DenseConfig(num_hidden_layers=3, layer_types=("full_attention", "sliding_attention", "full_attention"),
                      sliding_window=24, max_position_embeddings=512)
    return build_dense(cfg, seed=4, dtype=dtype)


def _yoco(dtype):
    from worker.model.yoco import YocoConfig, build_yoco
    return build_yoco(YocoConfig(sliding_window=24, max_position_embeddings=512), seed=5, dtype=dtype)


MODELS = {
    "hybrid-fp32": lambda: _hybrid(torch.float32),
    "hybrid-bf16": lambda: _hybrid(torch.bfloat16),
    "dense-fp32": lambda: _dense(torch.float32),
    "dense-bf16": lambda: _dense(torch.bfloat16),
    "dense-fp16": lambda: _dense(torch.float16),
    "yoco-fp32": lambda: _yoco(torch.float32),
    "yoco-bf16": lambda: _yoco(torch.bfloat16),
}


@pytest.fixture(scope="module", params=list(MODELS))
def family(request):
    return request.param, MODELS[request.param]()


def _tokens(n, seed=11):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


#: fp8 for every family, and the other precisions where they matter: a state keeping rows in
#: another dtype than it computes in (float32 buffers for bf16/fp16 compute), or rounding float32 rows.
CASES = [(f, "float8_e4m3fn") for f in MODELS] + [
    ("hybrid-fp32", "bfloat16"), ("hybrid-bf16", "float16"), ("dense-fp32", "bfloat16"),
    ("dense-bf16", "float16"), ("dense-fp16", "bfloat16"), ("yoco-fp32", "float16")]


@pytest.mark.parametrize("family,cache_dtype", CASES, indirect=["family"])
def test_resume_at_every_block_is_bit_identical_to_a_cold_run_at_that_precision(family, cache_dtype):
    name, model = family
    model.use_cache_dtype(cache_dtype)
    try:
        toks, decode = _tokens(6 * BS + 5), [7, 200, 3, 99]
        cold = model.new_state(BS, 8 * BS)
        cold_logits = model.prefill(toks, cold)
        blocks = [cold.export_block(i) for i in range(cold.completed_blocks)]
        cold_decode = torch.stack([model.decode_step(t, cold) for t in decode])
        for layout in cold.layouts.values():
            assert layout.spec.dtype == cache_dtype
        for n in range(1, len(blocks) + 1):
            warm = model.new_state(BS, 8 * BS)
            warm.restore(blocks, n)
            assert _equal(model.prefill(toks[n * BS:], warm), cold_logits[n * BS:]), (name, n)
            assert _equal(torch.stack([model.decode_step(t, warm) for t in decode]), cold_decode), (name, n)
            for i in range(n, len(blocks)):
                again = warm.export_block(i)
                assert all(_equal(again[f], blocks[i][f]) for f in blocks[i]), (name, n, i)
    finally:
        model.use_cache_dtype("auto")


@pytest.mark.parametrize("family,cache_dtype", CASES, indirect=["family"])
def test_decode_made_blocks_equal_prefill_made_blocks(family, cache_dtype):
    """Replies are cached: a block completed token by token holds the prefill's bytes."""
    name, model = family
    model.use_cache_dtype(cache_dtype)
    try:
        toks = _tokens(3 * BS + 1, seed=12)
        pre = model.new_state(BS, 4 * BS)
        model.prefill(toks, pre)
        dec = model.new_state(BS, 4 * BS)
        for t in toks:
            model.decode_step(t, dec)
        for i in range(3):
            a, b = pre.export_block(i), dec.export_block(i)
            assert all(_equal(a[f], b[f]) for f in a), (name, i)
    finally:
        model.use_cache_dtype("auto")


def test_batched_requests_equal_each_alone_at_fp8(family):
    name, model = family
    model.use_cache_dtype("float8_e4m3fn")
    try:
        prompts = [_tokens(n, seed=20 + n) for n in (5, 2 * BS, 3 * BS + 7)]
        alone = []
        for p in prompts:
            st = model.new_state(BS, 4 * BS)
            alone.append(model.extend(p, st, logits="last"))
        states = [model.new_state(BS, 4 * BS) for _ in prompts]
        together = model.forward_batch(list(zip(prompts, states)), logits="last")
        for a, b in zip(alone, together):
            assert _equal(a, b), name
    finally:
        model.use_cache_dtype("auto")


def test_precision_changes_the_spec_and_reads_back_rounded(family):
    """Another precision is another spec (hit validation's ABI layer refuses a replica of it),
    and a restored row holds the stored value (rounded), not the computed one."""
    name, model = family
    digests = {}
    for dt in CACHE_DTYPES:
        model.use_cache_dtype(dt)
        digests[dt] = {n: lay.spec.spec_digest for n, lay in model.form_layouts(BS).items()}
    model.use_cache_dtype("auto")
    auto_is = "float32" if name.startswith("hybrid") else str(model.dtype).removeprefix("torch.")  # dense, yoco
    stored = [dt for dt in CACHE_DTYPES if dt not in ("auto", auto_is)]
    for a in stored:
        assert digests[a] != digests["auto"], a
    assert digests[auto_is] == digests["auto"]


def test_fp8_costs_at_most_0_27_of_float32_per_form():
    for model in (_hybrid(torch.float32), _dense(torch.float32), _yoco(torch.float32)):
        model.use_cache_dtype("float32")
        f32 = {n: lay.spec.bytes_per_block for n, lay in model.form_layouts(BS).items()}
        model.use_cache_dtype("float8_e4m3fn")
        fp8 = {n: lay.spec.bytes_per_block for n, lay in model.form_layouts(BS).items()}
        model.use_cache_dtype("bfloat16")
        bf16 = {n: lay.spec.bytes_per_block for n, lay in model.form_layouts(BS).items()}
        model.use_cache_dtype("auto")
        for n in f32:
            assert fp8[n] / f32[n] <= 0.27, (n, fp8[n] / f32[n])
            assert bf16[n] * 2 == f32[n]


def test_a_form_too_narrow_for_fp8_groups_is_refused_by_name():
    model = _dense(torch.float32)
    narrow = build_dense(model.cfg.replace(head_dim=6, num_attention_heads=4, num_key_value_heads=2), seed=1)
    narrow.use_cache_dtype("float8_e4m3fn")
    with pytest.raises(StorageError, match="form 'kv'.*groups of 2 elements"):
        narrow.form_layouts(BS)
    with pytest.raises(StorageError, match="cache.dtype 'int4'"):
        narrow.use_cache_dtype("int4")


def test_storage_round_trip_is_idempotent_for_every_precision():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-5, 4, 32)
    for name in STORED + ("float32",):
        st = Storage(name)
        group = st.group("t", 32)
        once = st.round(x, group)
        assert _equal(st.round(once, group), once), name
        assert _equal(st.decode(st.encode(once, group), tuple(x.shape), torch.float32, group), once), name


def test_window_forms_keep_their_scope_at_every_precision(family):
    _, model = family
    for dt in STORED:
        model.use_cache_dtype(dt)
        scopes = {n: lay.spec.scope for n, lay in model.form_layouts(BS).items()}
        model.use_cache_dtype("auto")
        assert scopes == {n: lay.spec.scope for n, lay in model.form_layouts(BS).items()}
        assert all(isinstance(s, FormScope) for s in scopes.values())
