"""bench.model_thread on a small case: every key printed, the process's switch interval put back."""

from __future__ import annotations

import sys

import torch

from bench.model_thread import main


def test_a_small_run_reports_each_case_and_restores_the_switch_interval() -> None:
    before_threads, before_interval = torch.get_num_threads(), sys.getswitchinterval()
    try:
        keys = main(["--width", "256", "--batch", "2", "--history", "16", "--steps", "2", "--intervals", "1"])
    finally:
        torch.set_num_threads(before_threads)
    assert sys.getswitchinterval() == before_interval
    assert keys["step_ms_alone"] > 0
    for case in ("busy_1ms", "bursts_1ms"):
        assert keys[f"step_ms_{case}"] > 0 and keys[f"slowdown_{case}"] > 0 and keys[f"loop_share_{case}"] > 0
