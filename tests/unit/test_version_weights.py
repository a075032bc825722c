"""Gradual rollout, pure: the gateway's share per worker version (``gateway.version_weights``)
never takes a request away from the worker holding its prefix."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.routing import Worker, choose, pick_version
from shared.config import ConfigError, parse_config

FLEET = [Worker("a1", "http://a1", "ns", 16, version="1.4"), Worker("a2", "http://a2", "ns", 16, version="1.4"),
         Worker("b1", "http://b1", "ns", 16, version="1.5")]
WEIGHTS = {"1.4": 90, "1.5": 10}


def route(draw: float, usable: dict[str, int] | None = None, weights: dict[str, int] | None = WEIGHTS,
          fleet: list[Worker] = FLEET, **kw):
    return choose(fleet, usable or {}, {}, affinity="k", load_penalty_tokens=32, version_weights=weights,
                  draw=draw, **kw)


def test_requests_without_a_cached_prefix_are_shared_by_the_weights() -> None:
    n = 1000
    versions = Counter(route((i + 0.5) / n)[0].worker.version for i in range(n))
    assert versions == {"1.4": 900, "1.5": 100}
    first = route(0.95)
    assert first[0].worker.worker_id == "b1" and first[0].reason == "version"
    # the other version's workers stay in the failover order, after the drawn one
    assert [c.worker.worker_id for c in first] == ["b1", "a1", "a2"] or \
        [c.worker.worker_id for c in first] == ["b1", "a2", "a1"]


def test_a_cached_prefix_wins_over_the_draw_whatever_its_version() -> None:
    for draw in (0.0, 0.5, 0.99):
        best = route(draw, usable={"b1": 4})[0]
        assert (best.worker.worker_id, best.reason, best.cached_tokens) == ("b1", "cache", 64)
    # below gateway.version_prefix_tokens the draw decides, the cached worker ranked first within its version
    best = route(0.95, usable={"a1": 1}, version_prefix_tokens=32)[0]
    assert (best.worker.worker_id, best.reason) == ("b1", "version")
    best = route(0.1, usable={"a2": 1}, version_prefix_tokens=32)[0]
    assert (best.worker.worker_id, best.reason, best.cached_tokens) == ("a2", "version", 16)


def test_versions_without_usable_workers_give_their_share_to_the_rest() -> None:
    only_old = [w for w in FLEET if w.version == "1.4"]
    assert {route(d, fleet=only_old)[0].worker.version for d in (0.0, 0.5, 0.99)} == {"1.4"}
    drained = [*only_old, Worker("b1", "http://b1", "ns", 16, draining=True, version="1.5")]
    assert {c.worker.worker_id for c in route(0.99, fleet=drained)} == {"a1", "a2"}
    # no weight on any present version (or none configured): routing as without a rollout
    assert route(0.99, weights={"2.0": 1})[0].reason != "version"
    assert route(0.99, weights={})[0].reason != "version"
    # a version not listed gets none of the drawn traffic; one weighted 0 neither
    assert {route((i + 0.5) / 50, weights={"1.5": 1, "1.4": 0})[0].worker.version for i in range(50)} == {"1.5"}


def test_pick_version_shares_in_sorted_order() -> None:
    assert pick_version({"b": 1, "a": 3}, {"a", "b"}, 0.74) == "a"
    assert pick_version({"b": 1, "a": 3}, {"a", "b"}, 0.76) == "b"
    assert pick_version({"b": 1, "a": 3}, {"b"}, 0.0) == "b"
    assert pick_version({"b": 1}, {"a"}, 0.5) is None


def test_weights_and_versions_are_validated_naming_the_key() -> None:
    cfg = parse_config({"gateway": {"version_weights": {"1.4": 90, "1.5": 10}}, "worker": {"version": "1.5"}})
    assert cfg.gateway.version_weights == WEIGHTS and cfg.worker.version == "1.5"
    with pytest.raises(ConfigError, match=r"gateway\.version_weights"):
        parse_config({"gateway": {"version_weights": {"1.4": -1}}})
    with pytest.raises(ConfigError, match=r"worker\.version"):
        parse_config({"worker": {"version": "1.5 beta"}})
