"""Batch invariance: a request's logits are the same bits alone, in any batch, cut any way.

The property test runs random mixes of requests (prompt lengths, resume points, max_tokens,
priorities, arrival steps) through the real step loop (:class:`worker.stepper.Stepper`) with a
random token budget, and compares every request's logits, bit for bit, with the same request
run alone: a cold prefill in 1-block units, then one decode step per token.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kernels.invariant as inv
from kernels.invariant import MIN_COLS, ROW_FLOORS, linear, pointwise, probe
from kernels.sparse_attention.reference import sparse_attn_ref
from tests.fuzz import examples
from worker.stepper import Stepper

BLOCK = 16
CAP = 160


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_the_probe_passes_at_this_models_shapes(tiny) -> None:
    assert tiny.check_invariance() == []
    assert tiny.batch_invariant


def test_the_whole_forward_probe_passes_here_and_catches_a_batch_dependent_op(tiny, monkeypatch) -> None:
    """The engine's start-up probe runs the whole forward fused and alone. It passes on this
    machine, at every storage precision; an op whose bits depend on how many rows share the
    forward (here: the last hidden state scaled by a factor of the batch's row count) fails it,
    and the model then refuses fused forwards."""
    for cache_dtype in ("auto", "bfloat16", "float8_e4m3fn"):
        assert tiny.check_invariance(BLOCK, cache_dtype) == [] and tiny.batch_invariant
    hidden = tiny._hidden

    def by_rows(ids, batch, need):
        h = hidden(ids, batch, need)
        return h * (1 + 1e-3 * ids.numel())
    monkeypatch.setattr(tiny, "_hidden", by_rows)
    try:
        failures = tiny.check_invariance(BLOCK)
        assert failures and all(f.startswith("whole-forward probe: request") for f in failures)
        assert not tiny.batch_invariant
        with pytest.raises(RuntimeError, match="not batch-invariant"):
            tiny.forward_batch([([1], tiny.new_state(BLOCK, BLOCK)), ([2], tiny.new_state(BLOCK, BLOCK))])
    finally:
        monkeypatch.undo()
        assert tiny.check_invariance(BLOCK) == [] and tiny.batch_invariant


def test_a_passed_probe_is_reused_only_while_nothing_it_depends_on_changed(tiny, monkeypatch) -> None:
    """An engine built on a model another engine probed skips the forwards (``reuse=True``) — but
    only for the same block size, cache dtype and rules, untouched weights, and never after a
    run-time check distrusted the model."""
    runs = []
    probe = tiny.probe_forward
    monkeypatch.setattr(tiny, "probe_forward", lambda *a, **k: runs.append(a) or probe(*a, **k))
    tiny.distrust_invariance()                                  # forget what earlier tests' probes passed
    assert tiny.check_invariance(BLOCK, "auto", reuse=True) == [] and len(runs) == 1
    assert tiny.check_invariance(BLOCK, "auto", reuse=True) == [] and len(runs) == 1       # reused
    tiny.check_invariance(BLOCK, "bfloat16", reuse=True)
    tiny.check_invariance(BLOCK, "auto")                                    # reuse not asked for
    assert len(runs) == 3
    w = next(tiny.parameters())
    with torch.no_grad():
        w.add_(0.0)                                                         # written: version bumped
    tiny.check_invariance(BLOCK, "auto", reuse=True)
    assert len(runs) == 4
    tiny.distrust_invariance()
    assert not tiny.batch_invariant
    assert tiny.check_invariance(BLOCK, "auto", reuse=True) == [] and len(runs) == 5 and tiny.batch_invariant


def test_linear_rows_keep_their_bits_for_any_row_count() -> None:
    assert probe([(64, 4), (64, 8), (64, 128), (256, 24), (32, 256)], rows=range(1, 70)) == []
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 32, generator=g)               # fewer outputs than MIN_COLS: padded inside
    x = torch.randn(inv.MIN_ROWS + 3, 32, generator=g)
    assert torch.equal(bits(linear(x[:1], w)), bits(linear(x, w)[:1]))
    assert linear(x, w).shape == (inv.MIN_ROWS + 3, 5) and MIN_COLS > 5
    assert probe([], grouped=[(2, 128, 16), (4, 64, 32)], rows=range(1, 70)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_products_keep_each_groups_bits_whatever_the_group_count(dtype) -> None:
    """Attention runs one group per request and KV head, so a group's bits must not depend on
    how many groups share the product. Found with a float16 dense model: ATen's float16 bmm
    picks its kernel by the batch's size, and a fused decode step differed from a request alone."""
    g = torch.Generator().manual_seed(3)
    for k, n in inv.ATTENTION_SHAPES:
        for m in (1, 2, 8, 16):
            for _ in range(4):
                x = torch.randn(12, m, k, generator=g).to(dtype)
                w = torch.randn(12, k, n, generator=g).to(dtype)
                whole = inv.bmm_rows(x, w)
                for j in range(12):
                    assert torch.equal(bits(inv.bmm_rows(x[j:j + 1], w[j:j + 1])), bits(whole[j:j + 1])), (k, n, m, j)
    assert probe([], grouped=[(4, 64, 32)], rows=(1, 16), dtype=dtype) == []


def test_the_probe_fails_a_product_whose_groups_depend_on_their_number(monkeypatch) -> None:
    """A bmm that rounds one way alone and another way in company (as float16's did here) fails
    the probe, so a worker on such a machine does not fuse."""
    bmm = torch.bmm

    def company_rounds_up(x, w):
        y = bmm(x, w)
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.shape[0] > 1 else y

    monkeypatch.setattr(inv.torch, "bmm", company_rounds_up)
    failures = probe([], grouped=[(4, 64, 32)], rows=(1, 16))
    assert failures and "alone differs from the same group among" in failures[0]


def test_the_probe_checks_every_row_so_a_partial_tile_kernel_fails_it(monkeypatch) -> None:
    """A BLAS that computes the rows of a partial tile at the end of a product (the last
    ``m mod 8`` here) with another rounding is not invariant, even though every row in a whole
    tile agrees. The probe compares every row of every count, so it fails such a kernel (a
    probe of one middle row would pass it) — at every floor, and calibration then refuses.
    (The padded MKL path: the compiled product's own test is in tests/kernels/test_cpu_linear.py.)"""
    import types

    monkeypatch.setattr(inv, "_kernel", None)

    def tail_rounds_up(x, w, bias=None):
        y = torch.nn.functional.linear(x, w, bias)
        tail = x.shape[0] % 8
        if tail:
            y[-tail:] = torch.nextafter(y[-tail:], torch.full_like(y[-tail:], float("inf")))
        return y

    floor = inv.MIN_ROWS
    monkeypatch.setattr(inv, "F", types.SimpleNamespace(linear=tail_rounds_up))
    failures = probe([(64, 32)], rows=(*range(1, 34), 256))
    assert len(failures) == 1 and failures[0].startswith("linear 64->32 float32: row ")
    try:
        assert inv.calibrate([(64, 32)]) != [] and inv.MIN_ROWS == ROW_FLOORS[-1]
    finally:
        inv.MIN_ROWS = floor
    monkeypatch.undo()
    assert probe([(64, 32)]) == []


def test_the_probe_reaches_the_largest_forward_the_budget_allows(tiny, monkeypatch) -> None:
    """A budget above 256 rows is fused only if products that large keep every row's bits: a
    BLAS that switches blocking above 512 rows (rounded up here) passes a probe of 256 rows and
    fails one that reaches the budget; the engine probes up to ``service.max_batch_tokens``."""
    import types

    assert inv.probe_rows() == inv.PROBE_ROWS and inv.probe_rows(100) == inv.PROBE_ROWS
    assert set(inv.PROBE_ROWS) < set(inv.probe_rows(1024)) and max(inv.probe_rows(1024)) == 1024

    def large_rounds_up(x, w, bias=None):
        y = torch.nn.functional.linear(x, w, bias)
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.shape[0] > 512 else y

    floor = inv.MIN_ROWS
    monkeypatch.setattr(inv, "_kernel", None)           # the padded path's BLAS, here
    monkeypatch.setattr(inv, "F", types.SimpleNamespace(linear=large_rounds_up))
    try:
        assert inv.calibrate([(64, 32)], max_rows=256) == []
        assert inv.calibrate([(64, 32)], max_rows=1024) != []
    finally:
        inv.MIN_ROWS = floor
    monkeypatch.undo()
    seen: list[int] = []
    monkeypatch.setattr(type(tiny), "check_invariance",
                        lambda self, *a, max_rows=256, **k: seen.append(max_rows) or ["probe not run here"])
    from tests.worker.conftest import BS, config
    from worker.engine import Engine
    for budget, want in ((1024, 1024), (4, BS)):
        Engine(tiny, config(**{"service.max_batch_tokens": budget}))
        assert seen[-1] == want


def test_the_row_floor_is_calibrated_on_this_machine_and_only_grows() -> None:
    """The floor is this CPU's (4 rows on an AVX2 Xeon, 16 on an AVX-512/AMX one): the smallest
    candidate for which the probe passes, found at import; a later calibration never lowers it."""
    floor = inv.MIN_ROWS
    assert floor in ROW_FLOORS and probe([(256, 24), (1024, 256)]) == []
    below = [f for f in ROW_FLOORS if f < floor]
    if below:                                      # the floor is needed: the one below it fails
        inv.MIN_ROWS = below[-1]
        try:
            assert probe([(32, 256), (64, 256), (128, 12), (256, 24), (256, 256), (512, 320), (1024, 256)],
                         grouped=[(2, 128, 64), (4, 256, 128)]) != []
        finally:
            inv.MIN_ROWS = floor
    inv.MIN_ROWS = ROW_FLOORS[-1]
    try:
        assert inv.calibrate([(64, 128)]) == [] and inv.MIN_ROWS == ROW_FLOORS[-1]
    finally:
        inv.MIN_ROWS = floor


def test_pointwise_bits_do_not_depend_on_the_tensor_size() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, generator=g)
    for fn in (torch.exp, torch.sigmoid, torch.nn.functional.silu, torch.nn.functional.softplus):
        whole = pointwise(fn, x)
        for n in (1, 3, 17, 64, 65, 299):
            assert torch.equal(bits(pointwise(fn, x[:n])), bits(whole[:n])), (fn, n)


def test_attention_ignores_trailing_masked_keys_and_other_queries() -> None:
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(200, 64, generator=g)
    q = torch.randn(1, 4, 64, generator=g)
    sink = torch.randn(4, generator=g)
    own = torch.randint(0, 200, (1, 37), generator=g)
    alone = sparse_attn_ref(q, kv, own, sink, 0.125)
    for T, extra in ((1, 5), (3, 16), (9, 100)):
        Q = torch.randn(T, 4, 64, generator=g)
        Q[T // 2] = q[0]
        idx = torch.randint(0, 200, (T, 37 + extra), generator=g)
        idx[T // 2, :37], idx[T // 2, 37:] = own[0], -1
        assert torch.equal(bits(sparse_attn_ref(Q, kv, idx, sink, 0.125)[T // 2]), bits(alone[0]))


def _alone(model, prompt: list[int], resume: int, steps: int, cold_blocks) -> list[torch.Tensor]:
    """The reference: this request on its own (restored at ``resume`` blocks), greedy."""
    state = model.new_state(BLOCK, CAP)
    if resume:
        state.restore(cold_blocks, resume)
    logits = model.prefill(prompt[resume * BLOCK:], state, logits="last")
    out = [logits]
    for _ in range(steps - 1):
        logits = model.decode_step(int(torch.argmax(logits)), state)
        out.append(logits)
    return out


requests = st.lists(st.tuples(st.integers(1, 70),       # prompt length
                              st.integers(0, 4),        # resume point, in blocks (capped below)
                              st.integers(1, 5),        # max_tokens
                              st.integers(0, 2),        # priority
                              st.integers(0, 3)),       # arrival: event-loop turns to wait before submitting
                    min_size=1, max_size=6)


#: (service.model_lanes, service.lane_min_rows): one lane, or forwards split from 2 or 20 rows up.
LANES = st.sampled_from([(1, 256), (2, 2), (2, 20), (3, 2)])


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests, budget=st.sampled_from([1, 17, 48, 256, 1024]), seed=st.integers(0, 2**16),
       cap=st.sampled_from([0, 0, 16, 40]), lanes=LANES)
def test_random_mixes_run_batched_equal_each_request_run_alone(tiny, reqs, budget, seed, cap, lanes) -> None:
    """``cap``: service.max_prompt_tokens_with_decodes (prompts cut smaller beside decode tokens);
    ``lanes``: service.model_lanes and lane_min_rows (forwards split by request, run at once)."""
    check_mix(tiny, reqs, budget, seed, cap, lanes)


DENSE = {
    "llama-float32": ({}, torch.float32),
    "qwen2-sliding-bfloat16": ({"family": "qwen2", "qkv_bias": True, "sliding_window": 20,
                                "layer_types": ("sliding_attention", "full_attention") * 2}, torch.bfloat16),
    "qwen3-float16": ({"family": "qwen3", "qk_norm": True, "num_key_value_heads": 1}, torch.float16),
    "hybrid-bfloat16": (None, torch.bfloat16),
    "yoco-float32": ("yoco", torch.float32),
    "yoco-bfloat16": ("yoco", torch.bfloat16),
}


@pytest.fixture(scope="module", params=list(DENSE))
def dense(request):
    from worker.model import build_model
    from worker.model.dense import DenseConfig, build_dense
    from worker.model.yoco import YocoConfig, build_yoco
    over, dtype = DENSE[request.param]
    if over == "yoco":    # a short window, so prompts cross it
        model = build_yoco(YocoConfig(sliding_window=20), seed=4, dtype=dtype)
    else:
        model = build_model(seed=4).to(dtype) if over is None else build_dense(DenseConfig(**over), seed=4, dtype=dtype)
    assert model.check_invariance(BLOCK) == []     # the products, then the whole forward fused vs alone
    return model


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests, budget=st.sampled_from([1, 17, 48, 256, 1024]), seed=st.integers(0, 2**16), lanes=LANES)
# found by a random run: three float16 decode rows fused differed from each alone (bmm_rows)
@example(reqs=[(5, 0, 3, 1, 2), (12, 4, 3, 1, 1), (11, 4, 1, 0, 2), (27, 4, 5, 0, 0)], budget=256, seed=63814,
         lanes=(1, 256))
def test_dense_random_mixes_run_batched_equal_each_request_run_alone(dense, reqs, budget, seed, lanes) -> None:
    """The dense family (decode tokens of several requests share one attention call, each over
    its own padded keys; prefill units of one size likewise), the hybrid model in bfloat16 and
    the YOCO family (its cross-decoder on each piece's last row only): every request keeps its bits,
    in one forward or split into lanes."""
    check_mix(dense, reqs, budget, seed, lanes=lanes)


def check_mix(tiny, reqs, budget, seed, cap: int = 0, lanes: tuple[int, int] = (1, 256)) -> None:
    g = torch.Generator().manual_seed(seed)
    corpus = torch.randint(0, tiny.cfg.vocab_size, (CAP,), generator=g).tolist()
    cold = tiny.new_state(BLOCK, CAP)
    tiny.prefill(corpus[:5 * BLOCK], cold)
    cold_blocks = [cold.export_block(i) for i in range(5)]
    plans = []
    for n, resume, max_tokens, priority, arrival in reqs:
        resume = min(resume, (n - 1) // BLOCK)   # a resume leaves at least the last prompt token
        plans.append((corpus[:n], resume, max_tokens, priority, arrival))

    async def run_all() -> list[list[torch.Tensor]]:
        pool = ThreadPoolExecutor(1)
        # every second fused forward also runs one request alone and compares: no false alarm here
        stepper = Stepper(tiny, pool, max_batch_tokens=budget, block_size=BLOCK, check_every=2,
                          max_prompt_tokens_with_decodes=cap, lanes=lanes[0], lane_min_rows=lanes[1])
        steppers.append(stepper)

        async def one(k: int, prompt, resume, max_tokens, priority, arrival):
            for _ in range(arrival * 4):               # arrive later: a few loop turns, a forward or so
                await asyncio.sleep(0)
            state = tiny.new_state(BLOCK, CAP)
            if resume:
                state.restore(cold_blocks, resume)
            pos = resume * BLOCK

            def plan(max_t):
                nonlocal pos
                start = pos
                full = len(prompt) - len(prompt) % BLOCK
                end = len(prompt) if start >= full else min(full, start + max(BLOCK, (max_t or BLOCK) // BLOCK * BLOCK))
                pos = end
                return prompt[start:end], []

            res = None
            while pos < len(prompt):
                res = await stepper.prefill(state, plan, (priority, k))
            out = [res.logits]
            for _ in range(max_tokens - 1):
                out.append((await stepper.decode(state, int(torch.argmax(out[-1])), (priority, k))).logits)
            return out

        tasks = [asyncio.ensure_future(one(k, *p)) for k, p in enumerate(plans)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            pool.shutdown()
            stepper.close()

    steppers: list[Stepper] = []
    batched = asyncio.run(run_all())
    assert steppers[0].check_failures == 0
    for (prompt, resume, max_tokens, _, _), got in zip(plans, batched):
        want = _alone(tiny, prompt, resume, max_tokens, cold_blocks)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert torch.equal(bits(a), bits(b))


def test_two_intra_op_threads_turn_fusing_off(tiny) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        st_ = Stepper(tiny, None, max_batch_tokens=64, block_size=BLOCK)   # type: ignore[arg-type]
        assert not st_.fused
        with pytest.raises(RuntimeError, match="not batch-invariant"):
            tiny.forward_batch([([1, 2], tiny.new_state(BLOCK)), ([3], tiny.new_state(BLOCK))])
    finally:
        torch.set_num_threads(before)


def make(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_lanes_split_large_forwards_by_request_and_balance_their_rows() -> None:
    from worker.stepper import split_lanes
    assert split_lanes([1] * 8, 2, 256) == [list(range(8))]                 # small: one forward
    assert split_lanes([300], 2, 256) == [[0]]                               # one request: nothing to split
    assert split_lanes([100, 100, 100], 1, 2) == [[0, 1, 2]]                 # one lane
    assert split_lanes([128, 1, 1, 128], 2, 256) == [[0, 1], [2, 3]]          # largest first, fewest rows next
    assert split_lanes([200, 30, 20, 10], 2, 256) == [[0], [1, 2, 3]]
    assert split_lanes([5, 5], 3, 2) == [[0], [1]]                           # never an empty lane
    groups = split_lanes([64, 16, 48, 32, 1, 1], 3, 100)
    assert sorted(i for g in groups for i in g) == list(range(6)) and len(groups) == 3


def test_automatic_lanes_are_one_on_cuda_and_the_usable_cores_at_most_two_on_cpu(monkeypatch) -> None:
    from worker.stepper import resolve_lanes
    assert resolve_lanes(3, "cpu") == 3 and resolve_lanes(2, "cuda:0") == 2   # a setting is kept
    assert resolve_lanes(0, "cuda:1") == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0}, raising=False)
    assert resolve_lanes(0, "cpu", compiled=False) == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert resolve_lanes(0, "cpu", compiled=False) == 2
    # the compiled product runs every core itself: one lane (two measured no faster, bench.lanes)
    assert resolve_lanes(0, "cpu", compiled=True) == 1 and resolve_lanes(2, "cpu", compiled=True) == 2
    monkeypatch.setattr("worker.stepper.linear_path", lambda: "compiled-1")
    assert resolve_lanes(0, "cpu") == 1
    monkeypatch.setattr("worker.stepper.linear_path", lambda: "padded")
    assert resolve_lanes(0, "cpu") == 2


def test_a_forward_split_into_lanes_runs_at_once_and_each_request_keeps_its_bits(tiny, monkeypatch) -> None:
    """Four prompts in one step, two lanes: two forwards on two threads, each request's logits
    and the blocks it completes bit-identical to the request alone."""
    import threading
    threads: set[str] = set()
    forward = tiny.forward_batch

    def spy(work, **kw):
        threads.add(threading.current_thread().name)
        return forward(work, **kw)
    monkeypatch.setattr(tiny, "forward_batch", spy)
    prompts = [make(40, 1), make(33, 2), make(20, 3), make(16, 4)]

    async def scenario():
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvl-model")
        st_ = Stepper(tiny, pool, max_batch_tokens=1024, block_size=BLOCK, check_every=1, lanes=2, lane_min_rows=2)
        states = [tiny.new_state(BLOCK, CAP) for _ in prompts]
        try:
            def plan_for(p):
                return lambda _max: (p.tolist(), list(range(len(p) // BLOCK)))
            got = await asyncio.gather(*(st_.prefill(s, plan_for(p), (0, k))
                                         for k, (s, p) in enumerate(zip(states, prompts))))
            return got, st_
        finally:
            pool.shutdown()
            st_.close()

    got, st_ = asyncio.run(scenario())
    assert st_.forwards == 1 and st_.split_forwards == 1 and st_.check_failures == 0 and st_.checks == 1
    assert any(t.startswith("kvl-model") for t in threads) and any(t.startswith("kvl-lane") for t in threads)
    for p, r in zip(prompts, got):
        state = tiny.new_state(BLOCK, CAP)
        alone = forward([(p, state)], logits="last")[0]
        assert torch.equal(bits(r.logits), bits(alone))
        assert [i for i, _ in r.payloads] == list(range(len(p) // BLOCK))
        for i, payload in r.payloads:
            want = state.export_block(i)
            assert all(torch.equal(bits(payload[k]), bits(want[k])) for k in want)


def test_an_error_in_one_lane_fails_the_step_once_every_lane_has_finished(tiny, monkeypatch) -> None:
    """A lane's forward that raises fails every request of the step, and only after the other
    lane's forward returned (its states are not written behind the step's back)."""
    import threading
    import time as _time
    forward = tiny.forward_batch
    done: list[str] = []
    bad = tiny.new_state(BLOCK, CAP)

    def flaky(work, **kw):
        if any(item[1] is bad for item in work):
            raise RuntimeError("lane broke")
        _time.sleep(0.05)
        out = forward(work, **kw)
        done.append(threading.current_thread().name)
        return out
    monkeypatch.setattr(tiny, "forward_batch", flaky)

    async def scenario():
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvl-model")
        st_ = Stepper(tiny, pool, max_batch_tokens=1024, block_size=BLOCK, lanes=2, lane_min_rows=2)
        states = [tiny.new_state(BLOCK, CAP), bad]
        try:
            return await asyncio.gather(*(st_.prefill(s, lambda _m, n=n: (make(n, n).tolist(), []), (0, k))
                                          for k, (s, n) in enumerate(zip(states, (40, 30)))),
                                        return_exceptions=True)
        finally:
            pool.shutdown()
            st_.close()

    got = asyncio.run(scenario())
    assert all(isinstance(r, RuntimeError) and "lane broke" in str(r) for r in got), got
    assert len(done) == 1          # the healthy lane finished before the step failed


def test_a_fused_forward_that_differs_fails_its_step_and_fusing_stops(tiny, monkeypatch) -> None:
    """The stepper's run-time check catches what the start-up probe missed (here an op scaled by
    the forward's row count, patched in after the probe passed): the fused step's requests fail
    with ``FusedMismatch``, ``on_mismatch`` hears of it once, and from then on each request runs
    alone — and gets its exact logits."""
    from worker.stepper import FusedMismatch
    hidden = tiny._hidden
    monkeypatch.setattr(tiny, "_hidden", lambda ids, batch, need: hidden(ids, batch, need) * (1 + 1e-3 * ids.numel()))
    monkeypatch.setattr(tiny, "batch_invariant", True)
    heard: list[str] = []

    async def scenario():
        pool = ThreadPoolExecutor(1)
        st_ = Stepper(tiny, pool, max_batch_tokens=64, block_size=BLOCK, check_every=1, on_mismatch=heard.append)
        states = [tiny.new_state(BLOCK, CAP) for _ in range(2)]
        try:
            assert st_.fused and st_.describe()["fused"] and st_.describe()["why_not"] == ""
            first = await asyncio.gather(*(st_.decode(s, 7 + k, (0, k)) for k, s in enumerate(states)),
                                         return_exceptions=True)
            assert all(isinstance(r, FusedMismatch) for r in first), first
            assert not st_.fused and st_.checks == 1 and st_.check_failures == 1 and len(heard) == 1
            said = st_.describe()       # what /readyz shows an operator
            assert not said["fused"] and "run-time check" in said["why_not"] and said["check_failures"] == 1
            fresh = [tiny.new_state(BLOCK, CAP) for _ in range(2)]
            return await asyncio.gather(*(st_.decode(s, 7 + k, (0, k)) for k, s in enumerate(fresh))), st_
        finally:
            pool.shutdown()

    second, st_ = asyncio.run(scenario())
    assert st_.forwards == 3 and st_.segments == 4          # the fused one, then one request per forward
    for k, r in enumerate(second):
        alone = tiny.forward_batch([([7 + k], tiny.new_state(BLOCK, CAP))])[0]
        assert torch.equal(bits(r.logits), bits(alone))
