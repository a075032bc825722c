"""bench.lanes on a small case: both ways through the real stepper, one forward split in two, bits compared."""

from __future__ import annotations

import pytest
import torch

from bench.lanes import build, main, measure


def test_a_case_runs_both_ways_and_compares_every_requests_bits() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        row = measure(build("tiny"), "tiny", 3, 20, reps=1)
    finally:
        torch.set_num_threads(before)
    assert row["case"] == "tiny_3x20" and row["rows"] == 60 and row["bit_identical"] is True
    assert row["one_forward_ms"] > 0 and row["two_lanes_ms"] > 0 and row["speedup"] > 0


def test_a_negative_repetition_count_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--reps", "-1"])
