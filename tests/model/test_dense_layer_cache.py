"""``DenseLayer._weights``: a layer keeps the one-call path's weight arguments from its last forward,
and notices whatever would change them — a weight changed in place, replaced, or given new data, the
model moved to another dtype, the plain ops turned on — so its answer is always the checks' own."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import worker.model.dense.model as dm
from bench.model import dense_tiny
from kernels import layer_ops
from kernels.invariant import attention_serves, plain_ops

pytestmark = pytest.mark.skipif(layer_ops._ops is None or not attention_serves(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)),
                                reason="the compiled layer ops or attention are not built here")


def _logits(model) -> torch.Tensor:
    st = model.new_state(16, 256)
    out = [model.prefill(list(range(3, 40)), st, logits="last")]
    out += [model.decode_step(t, st) for t in (5, 6)]
    return torch.stack(out)


def _fresh(model) -> nn.Module:
    """The same weights in a model that never ran (a copy starts with nothing cached)."""
    twin = copy.deepcopy(model)
    assert all(layer._cached.value is None for layer in twin.model.layers)
    return twin


@pytest.fixture
def model():
    torch.set_num_threads(1)
    return dm.build_dense(dense_tiny("qwen2"), seed=2, dtype=torch.float32)   # biases: more parameters to watch


def test_a_warm_layer_uses_its_cached_arguments_and_gives_a_fresh_models_bits(model, monkeypatch) -> None:
    first = _logits(model)
    checks = {"n": 0}
    real = dm.DenseLayer._checked

    def counted(self, *a):
        checks["n"] += 1
        return real(self, *a)

    monkeypatch.setattr(dm.DenseLayer, "_checked", counted)
    again = _logits(model)
    assert checks["n"] == 0                      # every layer answered from its cache
    assert torch.equal(first, again) and torch.equal(again, _logits(_fresh(model)))


@pytest.mark.parametrize("change", ["in_place", "replaced", "new_data", "bias_in_place", "norm_in_place"])
def test_a_changed_parameter_is_noticed(model, change) -> None:
    _logits(model)                               # every layer caches
    layer = model.model.layers[1]
    with torch.no_grad():
        if change == "in_place":
            layer.self_attn.k_proj.weight.mul_(1.5)
        elif change == "replaced":
            layer.mlp.down_proj.weight = nn.Parameter(layer.mlp.down_proj.weight.detach() * 0.5)
        elif change == "new_data":
            layer.self_attn.o_proj.weight.data = layer.self_attn.o_proj.weight.detach().clone() * 2
        elif change == "bias_in_place":
            layer.self_attn.q_proj.bias.add_(0.25)
        else:
            layer.post_attention_layernorm.weight.mul_(0.5)
    got = _logits(model)
    assert torch.equal(got, _logits(_fresh(model)))
    assert not torch.equal(got, _logits(_fresh(dm.build_dense(dense_tiny("qwen2"), seed=2, dtype=torch.float32))))


def test_another_dtype_and_the_plain_ops_are_noticed(model) -> None:
    _logits(model)
    with plain_ops():
        plain = _logits(model)                   # the modules' plain path: the one call must not serve
        assert all(layer._cached.value[2] is None for layer in model.model.layers)
        assert torch.equal(plain, _logits(_fresh(model)))
    model.to(torch.bfloat16)
    got = _logits(model)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _logits(_fresh(model)))
