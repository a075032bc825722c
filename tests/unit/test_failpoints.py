"""Failpoints (``KVL_FAILPOINTS``): what a test may switch on in a real worker, and what a typo does."""

from __future__ import annotations

import pytest

from shared.config import ConfigError
from worker import failpoints


def test_known_names_parse_and_unknown_ones_are_a_configuration_error() -> None:
    assert failpoints.parse("") == frozenset()
    assert failpoints.parse(" fused_skew , ") == {"fused_skew"}
    with pytest.raises(ConfigError, match=r"\['fused_skwe'\].*known: \['fused_skew'\]"):
        failpoints.parse("fused_skew,fused_skwe")


def test_the_environment_is_read_once_and_off_by_default(monkeypatch) -> None:
    monkeypatch.delenv("KVL_FAILPOINTS", raising=False)
    failpoints.active.cache_clear()
    try:
        assert not failpoints.on("fused_skew")
        monkeypatch.setenv("KVL_FAILPOINTS", "fused_skew")
        assert not failpoints.on("fused_skew")          # read once: a running process does not change
        failpoints.active.cache_clear()
        assert failpoints.on("fused_skew")
        monkeypatch.setenv("KVL_FAILPOINTS", "nonsense")
        failpoints.active.cache_clear()
        with pytest.raises(failpoints.FailpointError):
            failpoints.on("fused_skew")
    finally:
        failpoints.active.cache_clear()
