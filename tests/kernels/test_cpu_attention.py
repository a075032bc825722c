"""The compiled batch-invariant attention (``kernels/cpu_linear/cpu_attention.cpp``) behind
``kernels.invariant.attention``.

A query row's bits must not depend on the rows, segments and keys beside it in the call, on how
its prompt is cut (a decode step, a prefill unit, a resumed prompt), on where its keys start in
the buffer, or on the thread count; and it must be attention (close to a float64 softmax).
Odd sizes on purpose: head dims not a multiple of the 16-lane vector, key counts not a multiple
of the 16-lane denominator, a window.
"""

from __future__ import annotations

import pytest
import torch

import kernels.invariant as inv

pytestmark = pytest.mark.skipif(inv._attention is None, reason="compiled attention unavailable")

DTYPES = [torch.float32, torch.bfloat16]


def reference(q, k, v, positions, window, scale):
    """float64 softmax attention, each row over keys max(0, t - window + 1) .. t of ``k``/``v`` (from 0)."""
    H, kvh = q.shape[1], k.shape[1]
    out = []
    for r, t in enumerate(positions.tolist()):
        a = max(0, t - window + 1) if window else 0
        kk = k[a:t + 1].double().repeat_interleave(H // kvh, 1)
        vv = v[a:t + 1].double().repeat_interleave(H // kvh, 1)
        p = torch.softmax(torch.einsum("hd,jhd->hj", q[r].double(), kk) * scale, -1)
        out.append(torch.einsum("hj,jhd->hd", p, vv))
    return torch.stack(out)


def data(L, H, kvh, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(L, n, D, generator=g).to(dtype) for n in (H, kvh, kvh))


def run(q, kv, bounds, positions, los, window, scale=0.125):
    return inv.attention(q, kv, bounds, positions, los, window, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,kvh,D,window", [(9, 3, 64, 0), (4, 4, 40, 0), (6, 2, 24, 37), (2, 1, 16, 0)])
def test_it_is_attention(dtype, H, kvh, D, window):
    L = 90
    q, k, v = data(L, H, kvh, D, dtype)
    pos = torch.arange(L)
    out = run(q, [(k, v)], [0, L], pos, [0], window, D ** -0.5)
    assert out.dtype == torch.float32 and out.shape == (L, H, D)
    torch.testing.assert_close(out.double(), reference(q, k, v, pos, window, D ** -0.5), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 48])
@pytest.mark.parametrize("H,kvh,D", [(9, 3, 64), (12, 2, 40)])   # 40: D not whole 32-element chunks;
def test_a_rows_bits_do_not_depend_on_its_company_or_its_cut(dtype, window, H, kvh, D):   # g 6: 24 rows a tile
    L = 260
    q, k, v = data(L, H, kvh, D, dtype, seed=1)
    pos = torch.arange(L)
    whole = run(q, [(k, v)], [0, L], pos, [0], window)          # one prefill of the whole prompt
    lo = lambda start: max(0, start - window + 1) if window else 0   # noqa: E731 - the caller's rule
    # a decode step: row 200 alone over exactly the keys it may read
    alone = run(q[200:201], [(k[lo(200):201], v[lo(200):201])], [0, 1], pos[200:201], [lo(200)], window)
    assert torch.equal(alone[0], whole[200])
    # the prompt cut into odd units, each a call of its own over the keys so far
    cuts = [0, 7, 16, 117, 118, 260]
    pieces = [run(q[a:b], [(k[lo(a):b], v[lo(a):b])], [0, b - a], pos[a:b], [lo(a)], window)
              for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(pieces), whole)
    # in a batch with other requests (other lengths, other keys), in either order
    q2, k2, v2 = data(50, H, kvh, D, dtype, seed=2)
    mixed = run(torch.cat([q2[40:50], q[150:260], q[3:4]]),
                [(k2[lo(40):50], v2[lo(40):50]), (k[lo(150):260], v[lo(150):260]), (k[lo(3):4], v[lo(3):4])],
                [0, 10, 120, 121], torch.cat([pos[40:50], pos[150:260], pos[3:4]]), [lo(40), lo(150), lo(3)], window)
    assert torch.equal(mixed[10:120], whole[150:260]) and torch.equal(mixed[120], whole[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_thread_count_does_not_change_a_bit(dtype):
    kernel = inv._attention
    before = kernel.get_threads()
    L, H, kvh, D = 300, 9, 3, 64
    q, k, v = data(L, H, kvh, D, dtype, seed=3)
    outs = []
    try:
        for threads in (1, 2, 3):
            kernel.set_threads(threads)
            outs.append(run(q, [(k, v)], [0, L], torch.arange(L), [0], 0))
    finally:
        kernel.set_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_keys_read_in_place_from_a_strided_buffer():
    """K/V as a state holds them: a slice of a [layers, capacity, kvh, D] buffer, read where it lies."""
    H, kvh, D = 6, 2, 32
    buf_k = torch.randn(3, 128, kvh, D)
    buf_v = torch.randn(3, 128, kvh, D)
    q = torch.randn(20, H, D)
    pos = torch.arange(40, 60)
    out = run(q, [(buf_k[1, 0:60], buf_v[1, 0:60])], [0, 20], pos, [0], 0)
    copy = run(q, [(buf_k[1, 0:60].clone(), buf_v[1, 0:60].clone())], [0, 20], pos, [0], 0)
    assert torch.equal(out, copy)
    torch.testing.assert_close(out.double(), reference(q, buf_k[1, :60], buf_v[1, :60], pos, 0, 0.125)[:],
                               atol=2e-6, rtol=2e-5)


def test_a_query_outside_its_keys_is_refused():
    q, k, v = data(8, 4, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="outside its segment"):
        run(q[7:8], [(k[:4], v[:4])], [0, 1], torch.tensor([7]), [0], 0)      # keys end at 3
    with pytest.raises(RuntimeError, match="outside its segment"):
        run(q[7:8], [(k[4:8], v[4:8])], [0, 1], torch.tensor([7]), [4], 0)    # keys 0..3 missing


def test_the_fingerprint_names_the_attention_arithmetic():
    assert f":attention-{inv.attention_path()}" in inv.compute_fingerprint()
    assert inv.attention_path().startswith("compiled-")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 20])
def test_attention_over_buffers_writes_the_rows_and_gives_the_same_bits_as_a_write_then_attention(dtype, window):
    """``attention_cached``: each segment's new rows land in its buffers (a decode row, a prompt
    piece, strided new rows as a fused product gives them), and the output equals writing them
    then calling :func:`attention` on the buffers' rows (the dense family's two paths)."""
    layers, cap, H, kvh, D = 3, 96, 6, 2, 24
    g = torch.Generator().manual_seed(4)
    lengths = [40, 61, 7]              # rows each request held before this forward
    news = [1, 5, 1]                   # rows each adds now
    bufs = [tuple(torch.randn(layers, cap, kvh, D, generator=g).to(dtype) for _ in range(2)) for _ in lengths]
    before = [(k.clone(), v.clone()) for k, v in bufs]
    N = sum(news)
    q = torch.randn(N, H, D, generator=g).to(dtype)
    wide = torch.randn(N, 3 * kvh * D, generator=g).to(dtype)
    k_new, v_new = wide[:, :kvh * D].view(N, kvh, D), wide[:, kvh * D:2 * kvh * D].view(N, kvh, D)
    bounds = [0, *torch.tensor(news).cumsum(0).tolist()]
    positions = torch.cat([torch.arange(n0, n0 + n) for n0, n in zip(lengths, news)])
    los = [max(0, n0 - window + 1) if window else 0 for n0 in lengths]
    layer = 1
    out = inv.attention_cached(q, k_new, v_new, bufs, layer, lengths, bounds, positions, los, window, 0.2)
    kv = []
    for s, ((k0, v0), n0, n) in enumerate(zip(before, lengths, news)):
        k0[layer, n0:n0 + n] = k_new[bounds[s]:bounds[s + 1]]
        v0[layer, n0:n0 + n] = v_new[bounds[s]:bounds[s + 1]]
        assert torch.equal(bufs[s][0], k0) and torch.equal(bufs[s][1], v0)   # only the new rows changed
        kv.append((k0[layer, los[s]:n0 + n], v0[layer, los[s]:n0 + n]))
    assert torch.equal(out, inv.attention(q, kv, bounds, positions, los, window, 0.2))


def test_attention_over_buffers_refuses_rows_past_a_buffer():
    k, v = torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8)
    q, new = torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside its buffers"):
        inv.attention_cached(q, new, new, [(k, v)], 0, [16], [0, 1], torch.tensor([16]), [0], 0, 1.0)


def _pool_prefix(bufs, nbs, bs, g):
    """Each request's first ``nbs[s]`` blocks copied into scattered slots of one pool laid out as the
    dense ``kv`` form (``[slots, layers, 2, bs, kvh, D]``, the other slots random), and its buffers' rows
    there overwritten with NaN (a read of them would show); returns the pool and the prefix tables."""
    layers, _, kvh, D = bufs[0][0].shape
    slots = sum(nbs) + 3
    pool = torch.randn(slots, layers, 2, bs, kvh, D, generator=g).to(bufs[0][0].dtype)
    free = iter(torch.randperm(slots, generator=g).tolist())
    tables = []
    for (k, v), nb in zip(bufs, nbs):
        tab = torch.empty(layers, nb, 2, dtype=torch.long) if nb else torch.empty(0, dtype=torch.long)
        for b in range(nb):
            i = next(free)
            pool[i, :, 0] = k[:, b * bs:(b + 1) * bs]
            pool[i, :, 1] = v[:, b * bs:(b + 1) * bs]
            for layer in range(layers):
                tab[layer, b, 0] = pool[i, layer, 0].data_ptr()
                tab[layer, b, 1] = pool[i, layer, 1].data_ptr()
        k[:, :nb * bs] = float("nan")
        v[:, :nb * bs] = float("nan")
        tables.append(tab)
    return pool, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("shape", [(6, 2, 24, 8), (9, 3, 64, 16), (3, 1, 40, 5)])
def test_attention_over_cached_blocks_read_in_place_gives_the_buffers_bits(dtype, window, shape):
    """A paged prefix (``prefixes``): each request's first blocks read from scattered pool slots, its
    buffers' rows there NaN (never read), gives exactly the bits of the same rows held in its
    buffers — decode rows, prompt pieces, a request with no cached block beside paged ones, a window
    that starts inside or past the cached blocks; odd head dims, a block size not a power of two."""
    H, kvh, D, bs = shape
    layers, cap = 3, 96
    g = torch.Generator().manual_seed(7)
    lengths = [40, 61, 7, 48]          # rows each request held before this forward
    news = [1, 5, 1, 3]
    nbs = [n0 // bs for n0 in lengths[:3]] + [0]
    bufs = [tuple(torch.randn(layers, cap, kvh, D, generator=g).to(dtype) for _ in range(2)) for _ in lengths]
    flat = [tuple(t.clone() for t in b) for b in bufs]
    N = sum(news)
    q = torch.randn(N, H, D, generator=g).to(dtype)
    k_new, v_new = (torch.randn(N, kvh, D, generator=g).to(dtype) for _ in range(2))
    bounds = [0, *torch.tensor(news).cumsum(0).tolist()]
    positions = torch.cat([torch.arange(n0, n0 + n) for n0, n in zip(lengths, news)])
    los = [max(0, n0 - window + 1) if window else 0 for n0 in lengths]
    layer = 2
    want = inv.attention_cached(q, k_new, v_new, flat, layer, lengths, bounds, positions, los, window, 0.2)
    assert not want.isnan().any()
    _pool, tables = _pool_prefix(bufs, nbs, bs, g)
    got = inv.attention_cached(q, k_new, v_new, bufs, layer, lengths, bounds, positions, los, window, 0.2, tables, bs)
    assert torch.equal(got, want)
    for s, n0 in enumerate(lengths):      # the new rows landed in the buffers, past the cached blocks
        assert torch.equal(bufs[s][0][layer, n0:n0 + news[s]], k_new[bounds[s]:bounds[s + 1]])

def test_attention_over_cached_blocks_refuses_a_write_into_a_cached_block():
    k, v = torch.zeros(2, 32, 1, 8), torch.zeros(2, 32, 1, 8)
    q, new = torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    tab = torch.zeros(2, 2, 2, dtype=torch.long)      # two cached blocks of 8: positions 0 .. 15
    with pytest.raises(RuntimeError, match="written into a cached block"):
        inv.attention_cached(q, new, new, [(k, v)], 0, [12], [0, 1], torch.tensor([12]), [0], 0, 1.0, [tab], 8)
