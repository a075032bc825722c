"""The dense decoder layer as one compiled call (``DenseLayer._one_call``, ``cpu_layer.cpp``'s
``dense_layer``) and the in-place attention per layer give exactly the bits of the modules run one
by one: alone and fused, prompts longer than a sliding window, biases, q/k norms, both dtypes.
(Every other model test runs the one-call path where it serves; this one pins it against the
module path, which still serves float16, fp8 cache storage, other families and the GPU.)"""

from __future__ import annotations

import pytest
import torch

import worker.model.dense.model as dm
from bench.model import dense_tiny
from kernels import layer_ops
from kernels.invariant import attention_serves, invariant_here

pytestmark = pytest.mark.skipif(layer_ops._ops is None or not attention_serves(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)),
                                reason="the compiled layer ops or attention are not built here")


def _run(model, monkeypatch, *, one_call: bool, in_place: bool):
    calls = {"one": 0}
    real = dm.DenseLayer._one_call

    def counted(self, *a):
        out = real(self, *a) if one_call else None
        calls["one"] += out is not None
        return out

    with monkeypatch.context() as m:
        m.setattr(dm.DenseLayer, "_one_call", counted)
        if not in_place:
            m.setattr(dm, "_in_place", lambda batch, dtype: None)
        g = torch.Generator().manual_seed(3)
        states = [model.new_state(16, 1024) for _ in range(3)]
        outs = [model.prefill(torch.randint(0, 200, (300 + 13 * i,), generator=g), st, logits="last")
                for i, st in enumerate(states)]
        for step in range(4):
            outs += model.forward_batch([([step * 7 + i], st) for i, st in enumerate(states)])
        outs += model.forward_batch([(list(range(5, 25)), states[0]), ([3], states[1]), ([4], states[2])])
        outs.append(model.decode_step(9, states[2]))
    return outs, calls["one"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_and_in_place_attention_give_the_modules_bits(family, dtype, monkeypatch):
    torch.set_num_threads(1)
    assert invariant_here()
    model = dm.build_dense(dense_tiny(family), seed=1, dtype=dtype)
    assert model.check_invariance(16) == []
    one, used = _run(model, monkeypatch, one_call=True, in_place=True)
    modules, unused = _run(model, monkeypatch, one_call=False, in_place=True)
    plain, _ = _run(model, monkeypatch, one_call=False, in_place=False)
    assert used > 0 and unused == 0                       # each path really ran
    assert all(torch.equal(a, b) for a, b in zip(one, modules))
    assert all(torch.equal(a, b) for a, b in zip(one, plain))


def test_fp8_cache_storage_takes_the_module_path(monkeypatch):
    """A state that rounds its rows (fp8 storage) has no in-place buffers: the modules run."""
    torch.set_num_threads(1)
    model = dm.build_dense(dense_tiny("llama"), seed=1)
    assert model.check_invariance(16) == []
    st = model.new_state(16, 256, cache_dtype="float8_e4m3fn")
    assert st.buffers_for(torch.float32) is None
    seen = []
    real = dm.DenseLayer._one_call
    monkeypatch.setattr(dm.DenseLayer, "_one_call", lambda self, *a: seen.append(real(self, *a)) or seen[-1])
    model.prefill(torch.arange(40), st)
    assert seen and all(s is None for s in seen)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_sized_unit_split_over_the_pool_gives_the_modules_bits(family, dtype, monkeypatch):
    """A unit of 1,100 rows: the layer's row-by-row ops (norms, rope, silu·up, residual adds) go to
    the product's pool in blocks of rows (past ~64K elements) and still give the modules' bits."""
    torch.set_num_threads(1)
    model = dm.build_dense(dense_tiny(family), seed=2, dtype=dtype)
    prompt = torch.randint(0, 200, (1100,), generator=torch.Generator().manual_seed(4))

    def run(one_call: bool) -> torch.Tensor:
        with monkeypatch.context() as m:
            if not one_call:
                m.setattr(dm.DenseLayer, "_one_call", lambda self, *a: None)
            return model.prefill(prompt, model.new_state(16, 1200), chunk_blocks=128, logits="all")

    assert torch.equal(run(True), run(False))
