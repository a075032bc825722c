"""Routing, pure: the coordinator's answer from live state, and the gateway's choice."""

from __future__ import annotations

from coordinator.core import acquire_lease, apply, ingest_transition, register_worker
from coordinator.core.route import route
from coordinator.core.state import LedgerState
from gateway.routing import Worker, choose
from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.messages import LeaseAcquire, ReplicaState, RouteQuery, TransitionEvent, WorkerRegister

NS = "ab" * 16
H = [f"{i:032x}" for i in range(1, 5)]
CAT = FormCatalogue(model_id="m", block_size=4, forms=(
    FormSpec(name="kv", scope=FormScope.FULL_HISTORY, bytes_per_block=8, dtype="float32"),))


def run(s, out):
    reply, events = out if isinstance(out, tuple) else (None, out)
    for e in events:
        apply(s, e)
    return reply


def fleet_with_two_blocks_on_w1() -> LedgerState:
    s = LedgerState.empty()
    for w in ("w1", "w2"):
        run(s, register_worker(s, WorkerRegister(worker_id=w, namespace=NS, catalogue=CAT, pool_slots={"kv": 8},
                                                 endpoint=f"http://{w}"), 1))
    run(s, acquire_lease(s, LeaseAcquire(worker_id="w1", epoch=1, namespace=NS, block_hashes=H[:2],
                                         write_forms=["kv"]), 2, "L1"))
    for seq, h in enumerate(H[:2], 1):
        run(s, ingest_transition(s, TransitionEvent(
            worker_id="w1", epoch=1, seq=seq, namespace=NS, block_hash=h, parent_hash="0" * 32, form="kv",
            location="gpu:w1", from_state=ReplicaState.ALLOCATED, to_state=ReplicaState.READY, generation=1,
            checksum="c" * 32, lease_id="L1", block_size=4), 3))
    return s


def test_the_route_answer_is_each_workers_longest_usable_prefix_and_decides_nothing() -> None:
    s = fleet_with_two_blocks_on_w1()
    applied = s.applied
    reply = route(s, RouteQuery(gateway_id="g", namespace=NS, block_hashes=H), fresh={"w1", "w2"})
    assert {c.worker_id: c.usable_blocks for c in reply.workers} == {"w1": 2, "w2": 0}
    assert s.applied == applied                        # nothing folded, nothing to log
    # a worker whose heartbeats stopped is not offered; another namespace's workers are not either
    assert [c.worker_id for c in route(s, RouteQuery(gateway_id="g", namespace=NS, block_hashes=H),
                                       fresh={"w2"}).workers] == ["w2"]
    assert route(s, RouteQuery(gateway_id="g", namespace="cd" * 16, block_hashes=H), fresh={"w1", "w2"}).workers == []
    # the fleet view: every fresh worker, no figures
    fleet = route(s, RouteQuery(gateway_id="g"), fresh={"w1", "w2"})
    assert {(c.worker_id, c.endpoint, c.block_size, c.usable_blocks) for c in fleet.workers} == {
        ("w1", "http://w1", 4, 0), ("w2", "http://w2", 4, 0)}


W = [Worker("a", "http://a", NS, 16), Worker("b", "http://b", NS, 16), Worker("c", "http://c", NS, 16)]


def test_most_cached_tokens_win_against_load() -> None:
    best = choose(W, {"b": 4}, {"b": 1}, affinity="x", load_penalty_tokens=32)
    assert best[0].worker.worker_id == "b" and best[0].reason == "cache" and best[0].cached_tokens == 64
    assert [c.worker.worker_id for c in best[1:]] and all(c.reason == "failover" for c in best[1:])
    # a cache worth less than its queue loses to an idle worker
    busy = choose(W, {"b": 1}, {"b": 3}, affinity="x", load_penalty_tokens=32)
    assert busy[0].worker.worker_id != "b"


def test_no_cache_anywhere_least_loaded_then_the_conversation_key() -> None:
    assert choose(W, {}, {"a": 2, "b": 1}, affinity="x", load_penalty_tokens=32)[0].worker.worker_id == "c"
    picks = {choose(W, {}, {}, affinity=key, load_penalty_tokens=32)[0].worker.worker_id for key in ("k1",) * 5}
    assert len(picks) == 1                             # the same key, the same worker
    spread = {choose(W, {}, {}, affinity=f"k{i}", load_penalty_tokens=32)[0].worker.worker_id for i in range(40)}
    assert spread == {"a", "b", "c"}                   # different conversations spread out
    assert choose(W, {}, {}, affinity="k1", load_penalty_tokens=32)[0].reason == "affinity"


def test_draining_and_down_workers_are_not_candidates_suspended_ones_come_last() -> None:
    ws = [Worker("a", "", NS, 16, draining=True), Worker("b", "", NS, 16, suspended=True), W[2]]
    got = choose(ws, {"a": 9, "b": 9}, {}, affinity="x", load_penalty_tokens=0)
    assert [(c.worker.worker_id, c.reason) for c in got] == [("c", "affinity"), ("b", "failover")]
    # a control-plane outage suspends the whole fleet: the endpoint still serves (without cache)
    all_suspended = [Worker(w, "", NS, 16, suspended=True) for w in "xyz"]
    got = choose(all_suspended, {}, {"x": 3}, affinity="k", load_penalty_tokens=32)
    assert got[0].reason == "suspended" and got[0].worker.worker_id != "x" and len(got) == 3
    assert choose(W, {}, {}, affinity="x", load_penalty_tokens=0, down=frozenset({"a", "b", "c"})) == []


def test_heartbeat_load_counts_what_other_gateways_sent() -> None:
    # this gateway has nothing in flight anywhere, but b's heartbeat says 3 running or queued
    ws = [Worker("a", "", NS, 16), Worker("b", "", NS, 16, reported_load=3)]
    assert choose(ws, {}, {}, affinity="x", load_penalty_tokens=32)[0].worker.worker_id == "a"
    # the larger of the two views counts: our own 5 in flight on a outweighs its stale heartbeat
    assert choose(ws, {}, {"a": 5}, affinity="x", load_penalty_tokens=32)[0].worker.worker_id == "b"


def test_the_route_answer_carries_each_workers_heartbeat_load() -> None:
    s = fleet_with_two_blocks_on_w1()
    reply = route(s, RouteQuery(gateway_id="g"), {"w1", "w2"}, {"w1": (2, 5)})
    got = {c.worker_id: (c.running, c.queued) for c in reply.workers}
    assert got == {"w1": (2, 5), "w2": (0, 0)}
