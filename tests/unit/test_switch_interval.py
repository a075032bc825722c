"""``worker.gil_switch_interval_ms``: bounds, and what the worker process does with it."""

from __future__ import annotations

import sys

import pytest

from shared.config import ConfigError, parse_config
from worker.engine_main import set_switch_interval


def test_the_worker_sets_the_switch_interval_it_is_given() -> None:
    before = sys.getswitchinterval()
    try:
        set_switch_interval(parse_config({"worker": {"gil_switch_interval_ms": 0.25}}))
        assert sys.getswitchinterval() == pytest.approx(0.00025)
        set_switch_interval(parse_config({}))
        assert sys.getswitchinterval() == pytest.approx(0.005)   # the default: CPython's
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("ms", [0, 0.01, 1000])
def test_a_switch_interval_out_of_bounds_is_refused_naming_the_key(ms) -> None:
    with pytest.raises(ConfigError, match="gil_switch_interval_ms"):
        parse_config({"worker": {"gil_switch_interval_ms": ms}})
