"""bench.serving_bound: N requests through the worker's real stepper in the fewest forwards, and
the bound it derives for bench.serving's measured ratios."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bench.serving_bound import for_serving, main, model_seconds
from worker.model import build_model


@pytest.fixture(scope="module")
def tiny():
    return build_model(seed=0)


def _forwards(model, n: int, budget: int, cached_rows: int = 0) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(1)
    try:
        seconds, forwards = model_seconds(model, n, 20, 2, budget=budget, lanes=1, lane_min_rows=512, pool=pool,
                                          cached_rows=cached_rows)
    finally:
        pool.shutdown()
        torch.set_num_threads(before)
    assert seconds > 0
    return forwards


def test_n_requests_run_in_the_fewest_forwards_the_budget_allows(tiny) -> None:
    # every prompt in one forward, then one forward per decode step for all of them
    assert _forwards(tiny, 1, 1024) == 3
    assert _forwards(tiny, 4, 1024) == 3
    # a budget of 32 rows: 4 prompts of 20 rows take at least 3 forwards (each forward's first
    # prompt may run a whole block), then the 2 decode steps
    assert _forwards(tiny, 4, 32) >= 5


def test_the_cached_context_is_computed_before_the_clock_and_not_counted(tiny) -> None:
    # 48 cached rows each: computed first (a forward not counted), then the same 3 timed forwards
    assert _forwards(tiny, 4, 1024, cached_rows=48) == 3


def _level(requests: int, wall_s: float, tokens: int, cached: float, cpu: dict | None = None) -> dict:
    return {"on": {"requests": requests, "wall_s": wall_s, "prompt_tokens": tokens * requests,
                   "completion_tokens": 2 * requests, "cached_fraction": cached,
                   **({"cpu_ms_per_request": cpu} if cpu else {})}}


def test_the_bound_for_a_serving_result_follows_its_definition() -> None:
    result = {"max_batch_tokens": 1024, "model_lanes_resolved": 1, "lane_min_rows": 512, "workload": {"levels": [1, 4]},
              "c1": _level(4, 0.4, 40, 0.5), "throughput_c4_vs_c1": 2.0,
              "c4": _level(16, 0.5, 40, 0.25, cpu={"worker": 40.0, "coordinator": 5.0, "postgres": 3.0, "nats": 2.0})}
    out = for_serving(result, quick=True)
    assert out["c1_wall_ms_per_request"] == 100.0
    # both printed rounded (the share to 3 places from the unrounded time): equal to within that
    assert 0 < out["c1_model_share"] == pytest.approx(out["bound_model_ms_c1"] / 100.0, abs=6e-4)
    assert out["bound_forwards_c4"] == 2          # four 24-row prompts (over 16 cached) in one forward, one decode
    aligned = 4 * 100.0 / out["bound_model_ms_c4"]  # the same tokens per request at both levels
    assert out["throughput_aligned_c4_vs_c1"] == pytest.approx(aligned, rel=1e-2)
    assert out["throughput_c4_vs_aligned"] == pytest.approx(2.0 / aligned, rel=1e-2)
    assert out["throughput_aligned_c4_vs_c1_any_budget"] > 0     # timed again with the largest budget
    ceiling = 4 * 100.0 * out["bound_cores"] / out["bound_work_ms_c4"]
    assert out["throughput_ceiling_c4_vs_c1"] == pytest.approx(ceiling, rel=1e-2)
    # every process's CPU per request at c = 4 (50 ms) against c = 1's wall time per request
    assert out["cpu_ms_per_request_c4"] == 50.0
    assert out["throughput_cpu_bound_c4_vs_c1"] == pytest.approx(out["bound_cores"] * 100.0 / 50.0, rel=1e-3)


def test_no_bound_without_c1_and_another_level() -> None:
    assert for_serving({"workload": {"levels": [8]}, "c8": _level(16, 0.5, 40, 0.25)}, quick=True) == {}
    assert for_serving({"workload": {"levels": [1]}, "c1": _level(4, 0.4, 40, 0.5)}, quick=True) == {}


@pytest.mark.parametrize("argv", [["--levels", "1,8"], ["--levels", "x"], ["--prompt-rows", "0"],
                                  ["--max-batch-tokens", "70000"], ["--model-lanes", "-3"], ["--cached-rows", "10"],
                                  ["--cached-rows", "-16"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
