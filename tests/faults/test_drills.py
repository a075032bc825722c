"""Fault drills on the real stack, part of ``make test`` (see ``drills.py`` for what each one does).

One stack for the module — embedded PostgreSQL and NATS owned by this test, a coordinator and
three worker processes — and one history: the drills run in turn (each heals whatever an
earlier failure left down first), then the whole history is checked and the ledger audited.
Each drill asserts zero mismatches against the cold reference, no conversation left
unanswered, and only the errors its fault explains; the last test asserts the checker and
the audit are clean and publishes the summary (``KVL_WRITE_RELIABILITY=1`` writes it to
docs/RELIABILITY.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.faults.drills import ALL, DRILLS, Run, Settings, audit_findings, final_check, note_lane_forwards
from tests.faults.report import numbers, publish

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow, pytest.mark.timeout(300)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Run]:
    r = Run(tmp_path_factory.mktemp("faults"), Settings(), tenants=list(DRILLS))
    try:
        await r.start()
        yield r
    finally:
        await r.stop()


@pytest.mark.parametrize("drill", DRILLS)
async def test_drill(run: Run, drill: str) -> None:
    await run.stack.heal()
    try:
        await ALL[drill](run, drill)
    except BaseException as e:
        run.failures.append((drill, f"{type(e).__name__}: {e}"))
        await run.abandon()
        raise
    await note_lane_forwards(run, drill)


async def test_history_is_clean_and_the_audit_passes(run: Run) -> None:
    report, audit = await final_check(run)
    publish(run, "make test: one pass of every drill", "make test (tests/faults/test_drills.py)")
    n = numbers(run)
    assert report.ok, f"history check: {report.problems()}"
    # illegal transitions published on purpose are each in the log once, rejected with a reason
    assert run.forged and all(typ == "transition.rejected" and reason for _, typ, reason in run.forged.values()), \
        run.forged
    # the audit compares every tier: it must find nothing the run does not explain, and it must
    # find the disk damage the drills injected
    assert not audit_findings(run, audit), f"audit: {audit_findings(run, audit)}\n{audit}"
    disk = audit.get("disk") or {}
    if {f.drill for f in run.faults} & {"offload-damage", "offload-readonly"} and disk.get("checked"):
        assert (disk.get("missing") or {}).get("count") or (disk.get("damaged") or {}).get("count"), disk
    assert n["mismatches"] == 0
    # wb ran its fused forwards as two lanes at once, and every answer above came through them too
    assert any(v > 0 for v in run.lane_forwards.values()), run.lane_forwards
    if "log-archive" in {f.drill for f in run.faults}:
        # the archived history verifies offline, and the audit replayed from its anchor
        assert run.archives_verified and run.archives_verified["ok"], run.archives_verified
        assert audit["replay_from"] == "archive_anchor", audit
    # every drill's load sent one conversation through the gateway (each drill checked its errors)
    assert n["gateway_requests"] > 0 and n["gateway_workers"] >= 1, n
    # the checker saw the run: transitions were published, acknowledged and logged
    assert report.acknowledged > 0 and report.logged >= report.acknowledged and report.pins > 0
    if {f.drill for f in run.faults} & {"worker-kill", "coordinator-stall-past-grace"}:
        assert report.losses > 0 and report.registrations > len(run.stack.specs), "no epoch was ever fenced"
    if {f.drill for f in run.faults} & {"coordinator-kill", "standby-takeover", "postgres-outage"}:
        assert report.suspensions > 0 and report.resumes > 0, "no epoch was suspended and resumed"
    # resumes for a fenced epoch or an unknown worker are refused, and the refusal is logged
    assert run.forged_resumes and all(code in ("fenced", "not_found") and seen == "logged"
                                      for code, seen in run.forged_resumes.values()), run.forged_resumes
