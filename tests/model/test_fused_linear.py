"""worker.model.linear.Fused: products over one input fused into one, with the parts' own bits."""

from __future__ import annotations

import pytest
import torch

from kernels.invariant import compiled_serves
from worker.model.linear import Fused, Linear

pytestmark = pytest.mark.skipif(not compiled_serves(torch.zeros(1, 8), torch.zeros(8, 8)),
                                reason="the compiled product is not built here (the parts then run alone)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_parts_have_the_bits_of_each_part_alone(dtype, bias) -> None:
    torch.manual_seed(0)
    parts = [Linear(96, n, bias=bias).to(dtype) for n in (96, 32, 32)]
    fused = Fused(*parts)
    for rows in (1, 3, 8, 37):
        x = torch.randn(rows, 96, dtype=dtype)
        alone = [p(x) for p in parts]
        got = fused(x)
        assert all(torch.equal(a, b) for a, b in zip(alone, got))
    # the parts' weights are views of the joined one: no second copy of the weights
    assert parts[0].weight.data_ptr() == fused._w.data_ptr()
    assert parts[1].weight.data_ptr() == fused._w[96:].data_ptr()


def test_a_changed_or_moved_weight_is_joined_again() -> None:
    torch.manual_seed(1)
    parts = [Linear(64, 64, bias=False) for _ in range(2)]
    fused = Fused(*parts)
    x = torch.randn(4, 64)
    fused(x)
    with torch.no_grad():
        parts[1].weight.mul_(2)                   # in place, as a checkpoint load does
    assert torch.equal(fused(x)[1], parts[1](x))
    for p in parts:
        p.to(torch.bfloat16)                      # new parameters
    xb = x.to(torch.bfloat16)
    assert all(torch.equal(a, p(xb)) for a, p in zip(fused(xb), parts))
    parts[0].weight = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))   # replaced outright
    assert torch.equal(fused(xb)[0], parts[0](xb))


def test_parts_with_and_without_a_bias_run_alone() -> None:
    parts = [Linear(32, 32, bias=True), Linear(32, 32, bias=False)]
    fused = Fused(*parts)
    x = torch.randn(2, 32)
    assert all(torch.equal(a, p(x)) for a, p in zip(fused(x), parts))
    assert fused._w is None
