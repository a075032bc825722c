"""What the drills excuse in the final audit, and only when the drill that explains it ran."""

from __future__ import annotations

from types import SimpleNamespace

from tests.faults.drills import audit_findings, drill_kind

CLEAN = {"hash_match": True, "log_errors": [], "invariant_violations": [], "replay_invariant_violations": [],
         "workers_unreachable": {}, "drift": {}}
DISK = {"disk": {"ledger_ready": 10, "checked": 10, "missing": {"count": 3}, "damaged": {"count": 1}}}


def run_of(*drills: str) -> SimpleNamespace:
    return SimpleNamespace(faults=[SimpleNamespace(drill=d) for d in drills])


def test_a_fault_named_by_the_soak_is_of_its_drill() -> None:
    assert drill_kind("offload-damage") == "offload-damage"
    assert drill_kind("offload-damage-1") == "offload-damage"
    assert drill_kind("coordinator-stall-0") == "coordinator-stall"
    assert drill_kind("coordinator-stall-past-grace-2") == "coordinator-stall-past-grace"
    assert drill_kind("something-else") == "something-else"


def test_damaged_disk_records_are_excused_only_after_a_drill_that_damages_them() -> None:
    audit = {**CLEAN, **DISK}
    assert audit_findings(run_of("coordinator-kill", "offload-full"), audit) == {"disk": DISK["disk"]}
    assert audit_findings(run_of("offload-damage"), audit) == {}
    # the soak's names: each drill's run carries its cycle (a soak once failed on its own excuse)
    assert audit_findings(run_of("coordinator-kill-0", "offload-damage-1"), audit) == {}
    assert audit_findings(run_of("offload-readonly-0"), audit) == {}
    assert audit_findings(run_of("offload-full-0"), audit) == {"disk": DISK["disk"]}
