"""The compiled layer ops (``kernels/cpu_linear/cpu_layer.cpp`` behind ``kernels.layer_ops``) give
exactly the bits of the torch expressions the models ran before them, so a cache either wrote
is valid for the other; where they cannot serve, the expressions themselves run."""

from __future__ import annotations

import pytest
import torch

import kernels.layer_ops as lo
from worker.model.norms import CastRMSNorm

pytestmark = pytest.mark.skipif(lo._ops is None, reason="compiled layer ops unavailable")

DTYPES = [torch.float32, torch.bfloat16]


def test_the_probe_finds_atens_sum_width_here():
    assert lo.probe() == "" and lo._lanes in (8, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576, 1000, 3072])
def test_rms_norm_has_the_reference_bits(dtype, n):
    """Other sizes and seeds than the probe's (1000: not a whole number of 16-lane vectors)."""
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(n, generator=g) + 1).to(dtype)
    for rows, scale in ((1, 1.0), (7, 100.0), (33, 1e-4)):
        x = (torch.randn(2, rows, n, generator=g) * scale).to(dtype)
        assert torch.equal(lo.cast_rms_norm(x, w, 1e-6), lo.reference_cast_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_silu_mul_have_the_reference_bits(dtype):
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(11, 3 * 7 * 32, generator=g).to(dtype)
    x = wide[:, 7 * 32:2 * 7 * 32].view(11, 7, 32)            # strided rows
    ang = torch.arange(11)[:, None].float() * 10 * torch.rand(16, generator=g)
    cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
    assert torch.equal(lo.rope(x, cos, sin), lo.reference_rope(x, cos, sin))
    gate, up = wide[:, :128] * 6, wide[:, 128:256]
    assert torch.equal(lo.silu_mul(gate, up), lo.reference_silu_mul(gate, up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_split_over_the_pool_have_the_reference_bits(dtype):
    """Prefill-sized calls (past ~64K elements) go to the product's pool in blocks of rows: the
    same bits as the expressions, with strided inputs (views of a fused product) as the layer has."""
    import kernels.cpu_linear as cl

    assert cl.load().get_threads() >= 1
    g = torch.Generator().manual_seed(9)
    rows, hidden, heads, d, inter = 301, 576, 9, 64, 1536
    w = (torch.randn(hidden, generator=g) + 1).to(dtype)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    assert torch.equal(lo.cast_rms_norm(x, w, 1e-5), lo.reference_cast_rms_norm(x, w, 1e-5))
    qkv = torch.randn(rows, (heads + 2 * 3) * d, generator=g).to(dtype)
    q = qkv[:, :heads * d].view(rows, heads, d)                 # strided rows
    ang = torch.arange(rows)[:, None].float() * torch.rand(d // 2, generator=g)
    cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
    assert torch.equal(lo.rope(q, cos, sin), lo.reference_rope(q, cos, sin))
    gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gu.split([inter, inter], -1)
    assert torch.equal(lo.silu_mul(gate, up), lo.reference_silu_mul(gate, up))


def test_what_the_compiled_ops_do_not_take_runs_the_reference():
    """float16, a row length that is not a whole number of lanes, autograd: the expression runs
    (here for the norm module, whose result must then carry a gradient)."""
    norm = CastRMSNorm(20, 1e-5)
    x = torch.randn(3, 20, requires_grad=True)
    y = norm(x)
    assert y.requires_grad and torch.equal(y, lo.reference_cast_rms_norm(x, norm.weight, 1e-5))
    h = torch.randn(2, 64).half()
    assert torch.equal(lo.cast_rms_norm(h, torch.ones(64).half(), 1e-5),
                       lo.reference_cast_rms_norm(h, torch.ones(64).half(), 1e-5))
