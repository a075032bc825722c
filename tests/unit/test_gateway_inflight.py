"""The gateway's prompts in flight, pure: what each worker is computing, and how the router weighs it."""

from __future__ import annotations

from gateway.inflight import InFlightPrefixes
from gateway.routing import Worker, choose

NS = "ab" * 16
W = [Worker("a", "http://a", NS, 16), Worker("b", "http://b", NS, 16), Worker("c", "http://c", NS, 16)]
P = [f"{i:032x}" for i in range(1, 9)]          # a prompt's chained block hashes


def test_a_prompts_leading_blocks_in_flight_on_a_worker_are_counted_until_its_request_ends() -> None:
    f = InFlightPrefixes()
    assert f.leading_blocks("a", P) == 0
    f.add("a", P[:6])                     # a request with a 6-block prompt, in flight on a
    assert f.leading_blocks("a", P) == 6 and f.leading_blocks("b", P) == 0
    assert f.leading_blocks("a", ["f" * 32, *P]) == 0          # a prefix, never a middle
    f.add("a", P[:3] + ["e" * 32])        # a second prompt sharing 3 blocks, then its own
    assert f.leading_blocks("a", P[:3] + ["e" * 32]) == 4
    f.remove("a", P[:6])                  # the first ended: the second still holds the shared three
    assert f.leading_blocks("a", P) == 3
    assert f.leading({"a": P, "b": P, "c": []}) == {"a": 3}
    f.remove("a", P[:3] + ["e" * 32])
    assert f.leading_blocks("a", P) == 0 and f.blocks_held() == 0
    f.remove("a", P)                      # a remove with nothing held changes nothing
    f.add("b", [])
    assert f.blocks_held() == 0


def test_a_burst_goes_where_its_prefix_is_being_computed_until_the_load_outweighs_it() -> None:
    # a new 8-block (128-token) prefix: nothing cached anywhere, a is computing it for one request
    got = choose(W, {}, {"a": 1}, affinity="x", load_penalty_tokens=32, inflight_blocks={"a": 8})
    assert got[0].worker.worker_id == "a" and got[0].reason == "inflight" and got[0].cached_tokens == 128
    # without the credit the same burst spreads: a busy worker loses to an idle one
    assert choose(W, {}, {"a": 1}, affinity="x", load_penalty_tokens=32)[0].worker.worker_id != "a"
    # five in flight weigh 5 × 32 = 160 tokens, more than the prefix: the sixth goes elsewhere
    assert choose(W, {}, {"a": 5}, affinity="x", load_penalty_tokens=32,
                  inflight_blocks={"a": 8})[0].worker.worker_id != "a"
    # blocks cached and blocks in flight on one worker are not added up: the larger counts
    got = choose(W, {"b": 5}, {}, affinity="x", load_penalty_tokens=32, inflight_blocks={"b": 3})
    assert got[0].worker.worker_id == "b" and got[0].reason == "cache" and got[0].cached_tokens == 80
    got = choose(W, {"b": 2}, {}, affinity="x", load_penalty_tokens=32, inflight_blocks={"b": 3, "c": 1})
    assert got[0].worker.worker_id == "b" and got[0].reason == "inflight" and got[0].cached_tokens == 48
