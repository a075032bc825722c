"""The audit's comparison of a worker's inventory with the ledger, tier by tier (pure: no I/O)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from coordinator.audit import audit_workers, compare_tiers, drift_entry
from coordinator.core import ingest_transition
from coordinator.core.state import LedgerState
from shared.messages import InventoryItem, InventoryReply, ReplicaState as S

from tests.unit.core.support import h, held, transition
from tests.unit.core.test_commands import Seq, fresh, warm


def _ledger():  # type: ignore[no-untyped-def]
    """w1: blocks 0 and 1 READY on its GPU (3 forms each), host copies of block 0 (swa, tail)."""
    d, seq = fresh(), Seq()
    warm(d, [h(0), h(1)], seq)
    for form in ("swa", "tail"):
        out = d.run(ingest_transition, transition("w1", 1, seq(), h(0), form, None, S.READY, location="host:w1",
                                                  generation=0, checksum="c0"), 6)
        assert type(out[0]).__name__ == "TransitionApplied"
    return d, seq


def _holdings(state: LedgerState) -> dict[str, list[bytes]]:
    """What w1 really holds: exactly what the ledger lists READY on its GPU and host tier."""
    out: dict[str, list[bytes]] = {"gpu:w1": [], "host:w1": []}
    for k, r in state.replicas.items():
        if k[2] in out and r.state is S.READY:
            out[k[2]].append(held(*k, r.generation, r.checksum))
    return out


def _reply(by_loc: dict[str, list[bytes]], epoch: int = 1) -> InventoryReply:
    return InventoryReply(worker_id="w1", epoch=epoch, digests=b"".join(d for v in by_loc.values() for d in v),
                          locations=[(loc, len(v)) for loc, v in by_loc.items()])


def test_a_worker_holding_what_the_ledger_lists_has_no_drift() -> None:
    d, _ = _ledger()
    tiers = compare_tiers(d.state, "w1", _reply(_holdings(d.state)))
    assert {loc: (len(t.ledger_ready), len(t.held)) for loc, t in tiers.items()} == {"gpu:w1": (6, 6),
                                                                                      "host:w1": (2, 2)}
    assert drift_entry(tiers, None, (1, 1)) == {}


def test_lost_host_copies_and_unknown_replicas_are_counted_per_tier() -> None:
    d, _ = _ledger()
    has = _holdings(d.state)
    lost = has["host:w1"].pop()
    extra = held(h(9), "swa", "host:w1", 0, "c9")
    has["host:w1"].append(extra)
    has["gpu:w1"] = has["gpu:w1"][1:]
    out = drift_entry(compare_tiers(d.state, "w1", _reply(has)), None, (1, 1))
    assert out["tiers"] == {"gpu:w1": {"ledger_only": 1, "worker_only": 0},
                            "host:w1": {"ledger_only": 1, "worker_only": 1}}
    assert out["missing_on_worker"]["count"] == 2
    assert [h(0), "tail" if lost == held(h(0), "tail", "host:w1", 0, "c0") else "swa", "host:w1"] in \
        out["missing_on_worker"]["replicas"]
    assert out["unknown_to_ledger"] == {"count": 1, "digests": [extra.hex()]}


def test_a_stale_generation_or_checksum_is_drift_both_ways() -> None:
    d, _ = _ledger()
    has = _holdings(d.state)
    key = next(k for k in d.state.replicas if k[2] == "gpu:w1")
    r = d.state.replicas[key]
    has["gpu:w1"].remove(held(*key, r.generation, r.checksum))
    has["gpu:w1"].append(held(*key, r.generation, "corrupted"))
    out = drift_entry(compare_tiers(d.state, "w1", _reply(has)), None, (1, 2))
    assert out["tiers"] == {"gpu:w1": {"ledger_only": 1, "worker_only": 1}}
    assert out["epoch"] == {"ledger": 1, "worker": 2}


def test_a_second_round_keeps_only_what_lasted() -> None:
    d, _ = _ledger()
    has = _holdings(d.state)
    has["host:w1"] = []
    first = compare_tiers(d.state, "w1", _reply(has))
    has["host:w1"] = _holdings(d.state)["host:w1"][:1]       # one copy was only in flight
    second = compare_tiers(d.state, "w1", _reply(has))
    before = {loc: (t.ledger_only, t.worker_only) for loc, t in first.items()}
    assert drift_entry(second, before, (1, 1))["tiers"] == {"host:w1": {"ledger_only": 1, "worker_only": 0}}


def test_an_inventory_of_items_is_compared_by_key() -> None:
    """Workers that answer with items (no digests) are still compared, on both tiers."""
    d, _ = _ledger()
    items = [InventoryItem(block_hash=k[0], form=k[1], location=k[2], generation=r.generation, state=S.READY)
             for k, r in d.state.replicas.items() if k[2] in ("gpu:w1", "host:w1") and k[1] != "tail"]
    out = drift_entry(compare_tiers(d.state, "w1", InventoryReply(worker_id="w1", epoch=1, items=items)), None, (1, 1))
    assert out["tiers"] == {"gpu:w1": {"ledger_only": 2, "worker_only": 0}, "host:w1": {"ledger_only": 1,
                                                                                         "worker_only": 0}}


class _Frozen:
    def __init__(self, state: LedgerState) -> None:
        self.state = state

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[LedgerState]:
        yield self.state


async def test_a_moment_s_difference_is_not_reported_and_a_suspended_worker_is_skipped() -> None:
    d, seq = _ledger()
    has = _holdings(d.state)
    calls: list[Any] = []

    async def inventory(wid: str, timeout_s: float, digests: bool = False, disk: Any = None) -> Any:
        calls.append(wid)
        if len(calls) == 1:          # the first look misses a host copy being put back
            return _reply({"gpu:w1": has["gpu:w1"], "host:w1": has["host:w1"][:1]})
        return _reply(has)
    out = await audit_workers(_Frozen(d.state), inventory, confirm_s=0.01, disk_checks=0)
    assert out["drift"] == {} and out["workers_checked"] == ["w1"] and len(calls) == 2

    d.state.workers["w1"].suspended_at_ms = 5
    out = await audit_workers(_Frozen(d.state), inventory, confirm_s=0.01, disk_checks=0)
    assert out["workers_checked"] == [] and "w1" in out["workers_skipped"] and len(calls) == 2
