"""longest_usable_prefix over a catalogue of full-history, window and resume-point forms."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as strat

from coordinator.core import CoreParams, LedgerState, longest_usable_prefix
from coordinator.core.state import Replica
from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.messages import ReplicaState as S
from tests.fuzz import examples

from .support import h

BS = 4
CAT = FormCatalogue(model_id="m", block_size=BS, forms=(
    FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=8, dtype="float32"),
    FormSpec(name="indexer", scope=FormScope.FULL_HISTORY, bytes_per_block=8, dtype="float32"),
    # 9 tokens → ceil(9/4) = 3 blocks before the boundary.
    FormSpec(name="swa", scope=FormScope.WINDOW, bytes_per_block=8, dtype="float32", window_tokens=9),
    FormSpec(name="tail", scope=FormScope.RESUME_POINT, bytes_per_block=8, dtype="float32"),
))
LOCS = ("gpu:w1", "host:n1", "disk")


def world(n: int, missing: dict[str, set[int]] | None = None, where: str = "gpu:w1",
          states: dict[tuple[int, str], S] | None = None) -> tuple[LedgerState, list[str]]:
    """Every form of blocks 0..n-1 READY at ``where``, except ``missing[form]`` (absent)."""
    s = LedgerState.empty(CoreParams())
    missing = missing or {}
    for i in range(n):
        for f in CAT.names:
            if i in missing.get(f, set()):
                continue
            st = (states or {}).get((i, f), S.READY)
            s.replicas[(h(i), f, where)] = Replica(h(i), f, where, st, generation=1)
    return s, [h(i) for i in range(n)]


def pinned(res: object) -> list[tuple[int, str]]:
    return [(int(k[0], 16), k[1]) for k in res.replicas_to_pin]  # type: ignore[attr-defined]


def test_everything_ready_uses_every_block() -> None:
    s, blocks = world(6)
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 6 and res.rejected == []
    assert pinned(res) == ([(i, "compressed") for i in range(6)] + [(i, "indexer") for i in range(6)]
                           + [(3, "swa"), (4, "swa"), (5, "swa")] + [(5, "tail")])


def test_full_history_gap_bounds_the_prefix() -> None:
    s, blocks = world(8, missing={"indexer": {5}})
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 5
    assert res.rejected == ["p=6..8 blocks: indexer of block 5 not READY"]
    s, blocks = world(8, missing={"compressed": {7}})
    assert longest_usable_prefix(s, CAT, blocks, LOCS).rejected == ["p=8 blocks: compressed of block 7 not READY"]


def test_gap_at_block_zero_leaves_nothing() -> None:
    s, blocks = world(4, missing={"compressed": {0}})
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert (res.usable_blocks, res.replicas_to_pin) == (0, [])
    assert res.rejected == ["p=1..4 blocks: compressed of block 0 not READY"]


def test_non_ready_states_do_not_count() -> None:
    for st in (S.ALLOCATED, S.EVICTED, S.INVALID, S.LOST):
        s, blocks = world(4, states={(2, "compressed"): st})
        assert longest_usable_prefix(s, CAT, blocks, LOCS).usable_blocks == 2


def test_window_needs_only_the_last_blocks_and_fewer_near_the_start() -> None:
    # swa missing for blocks 0..2: at p=6 the window is blocks 3,4,5 — fine.
    s, blocks = world(6, missing={"swa": {0, 1, 2}})
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 6 and res.rejected == []
    assert [b for b, f in pinned(res) if f == "swa"] == [3, 4, 5]
    # Near the start the window is shorter: at p=2 it is blocks 0,1 only (not 3 blocks).
    s, blocks = world(2)
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 2 and [b for b, f in pinned(res) if f == "swa"] == [0, 1]
    s, blocks = world(1)
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 1 and pinned(res) == [(0, "compressed"), (0, "indexer"), (0, "swa"), (0, "tail")]


def test_window_gap_falls_back_below_it() -> None:
    # swa of block 4 missing: p=7 (window 4,5,6), p=6, p=5 all contain it; p=4 (window 1,2,3) is fine.
    s, blocks = world(7, missing={"swa": {4}})
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 4
    assert res.rejected == ["p=7 blocks: swa of block 4 not READY", "p=6 blocks: swa of block 4 not READY",
                            "p=5 blocks: swa of block 4 not READY"]


def test_resume_point_missing_at_the_longest_falls_back_to_a_shorter_boundary() -> None:
    s, blocks = world(6, missing={"tail": {5, 4, 2}})
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 4
    assert res.rejected == ["p=6 blocks: tail of block 5 not READY", "p=5 blocks: tail of block 4 not READY"]
    assert [b for b, f in pinned(res) if f == "tail"] == [3]
    assert [b for b, f in pinned(res) if f == "swa"] == [1, 2, 3]


def test_minimum_is_one_block() -> None:
    s, blocks = world(3, missing={"tail": {1, 2}})
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 1
    s, blocks = world(3, missing={"tail": {0, 1, 2}})
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 0 and res.replicas_to_pin == []
    assert res.rejected == [f"p={p} blocks: tail of block {p - 1} not READY" for p in (3, 2, 1)]


def test_empty_request() -> None:
    s, _ = world(0)
    assert longest_usable_prefix(s, CAT, [], LOCS).usable_blocks == 0


def test_locations_in_order_and_only_readable_ones() -> None:
    s, blocks = world(3, where="disk")
    for i in range(3):
        for f in CAT.names:
            s.replicas[(h(i), f, "gpu:w1")] = Replica(h(i), f, "gpu:w1", S.READY if i < 2 else S.EVICTED)
    res = longest_usable_prefix(s, CAT, blocks, LOCS)
    assert res.usable_blocks == 3
    by = {(int(k[0], 16), k[1]): k[2] for k in res.replicas_to_pin}
    assert by[(0, "compressed")] == "gpu:w1" and by[(2, "compressed")] == "disk"
    # Another worker's GPU is not readable.
    s2, blocks = world(3, where="gpu:w2")
    assert longest_usable_prefix(s2, CAT, blocks, LOCS).usable_blocks == 0


def test_rejected_reasons_are_capped() -> None:
    s, blocks = world(40, missing={"tail": set(range(1, 40))})
    res = longest_usable_prefix(s, CAT, blocks, LOCS, max_reasons=5)
    assert res.usable_blocks == 1
    assert len(res.rejected) == 6 and res.rejected[-1] == "... and 34 shorter boundaries rejected"


def _lines_run(fn: Callable[[], object]) -> tuple[object, int]:
    """``fn()`` and how many lines of ``coordinator/core/prefix.py`` it ran: the search's work,
    counted rather than timed (a timed bound failed in CI on a machine that stalled 0.7 s)."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if not frame.f_code.co_filename.endswith("prefix.py"):
            return None
        count += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        out = fn()
    finally:
        sys.settrace(None)
    return out, count


def test_long_prompts_are_linear() -> None:
    # Worst case for a naive search: tail READY only at block 0, so every boundary is examined.
    work = {}
    for n in (500, 2000):
        s, blocks = world(n, missing={"tail": set(range(1, n)), "swa": {n - 10}})
        res, work[n] = _lines_run(lambda: longest_usable_prefix(s, CAT, blocks, LOCS))
        assert res.usable_blocks == 1   # type: ignore[attr-defined]
    # 4x the blocks, about 4x the lines (a search quadratic in the blocks would run ~16x)
    assert work[2000] < 5 * work[500], work


def _oracle(s: LedgerState, blocks: list[str], locs: tuple[str, ...]) -> tuple[int, list[tuple[str, str, str]]]:
    """The definition, boundary by boundary from the longest: every form usable by its scope,
    each block's replica the first READY one in ``locs`` order."""
    def first(i: int, form: str) -> tuple[str, str, str] | None:
        for loc in locs:
            r = s.replicas.get((blocks[i], form, loc))
            if r is not None and r.state is S.READY:
                return (blocks[i], form, loc)
        return None

    for p in range(len(blocks), 0, -1):
        need = []
        for spec in CAT.forms:
            lo = {FormScope.FULL_HISTORY: 0, FormScope.WINDOW: max(0, p - CAT.window_blocks(spec)),
                  FormScope.RESUME_POINT: p - 1}[spec.scope]
            need += [first(i, spec.name) for i in range(lo, p)]
        if None not in need:
            return p, need          # type: ignore[return-value]
    return 0, []


@given(strat.lists(strat.lists(strat.sampled_from(["none", "ready", "other"]), min_size=len(LOCS), max_size=len(LOCS)),
                min_size=0, max_size=14 * len(CAT.forms)),
       strat.lists(strat.sampled_from(LOCS), min_size=1, max_size=3, unique=True))
@settings(max_examples=examples(300), deadline=None)
def test_the_search_agrees_with_the_definition(cells: list[list[str]], readable: list[str]) -> None:
    """Random replicas (absent, READY or in another state, at each location) for every (block,
    form): the downward, probe-once search finds the boundary and the pins the definition does."""
    n = len(cells) // len(CAT.forms)
    s = LedgerState.empty(CoreParams())
    blocks = [h(i) for i in range(n)]
    for c, where in enumerate(cells[:n * len(CAT.forms)]):
        i, form = divmod(c, len(CAT.forms))
        for loc, what in zip(LOCS, where):
            if what != "none":
                st_ = S.READY if what == "ready" else S.ALLOCATED
                s.replicas[(blocks[i], CAT.names[form], loc)] = Replica(blocks[i], CAT.names[form], loc, st_,
                                                                        generation=1)
    res = longest_usable_prefix(s, CAT, blocks, tuple(readable))
    p, pins = _oracle(s, blocks, tuple(readable))
    assert (res.usable_blocks, res.replicas_to_pin) == (p, pins)
    assert len(res.rejected) <= 17 and (res.rejected == []) == (p == n)
