"""The fault soak: every drill, several cycles in a shuffled order, longer and wider load.

Runs only with ``pytest tests/faults --soak`` or ``KVL_SOAK=1``; ``KVL_SOAK_CYCLES`` (default
3) sets the number of cycles, ``KVL_SOAK_SEED`` the order. A drill that fails is recorded and
the soak goes on (the next drill heals the stack first), so one run reports every failure;
the test fails at the end if any drill failed, any answer differed from its cold run, or the
history check or the audit is not clean.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.faults.drills import ALL, DRILLS, Run, Settings, audit_findings, final_check
from tests.faults.report import numbers, publish

pytestmark = [pytest.mark.soak, pytest.mark.timeout(0)]


async def test_soak(tmp_path_factory: pytest.TempPathFactory) -> None:
    cycles = int(os.environ.get("KVL_SOAK_CYCLES", "3"))
    seed = int(os.environ.get("KVL_SOAK_SEED", "1"))
    rng = random.Random(seed)
    settings = Settings(conversations=6, turns=5, postgres_down_s=8.0, nats_down_s=3.0, coordinator_down_s=3.0,
                        before=6, after=6)
    run = Run(tmp_path_factory.mktemp("soak"), settings,
              tenants=[f"{d}-{c}" for c in range(cycles) for d in DRILLS])
    try:
        await run.start()
        for c in range(cycles):
            order = list(DRILLS)
            rng.shuffle(order)
            for drill in order:
                await run.stack.heal()
                try:
                    await ALL[drill](run, f"{drill}-{c}")
                except Exception as e:  # noqa: BLE001 - recorded; the soak goes on and fails at the end
                    run.failures.append((f"{drill} (cycle {c})", f"{type(e).__name__}: {e}"))
                    await run.abandon()
        report, audit = await final_check(run)
    finally:
        if run.report is not None:
            publish(run, f"Soak: {cycles} cycles of every drill, shuffled (seed {seed})",
                    f"KVL_SOAK_CYCLES={cycles} KVL_SOAK_SEED={seed} pytest tests/faults --soak")
        await run.stop()
    assert not run.failures, "drills failed:\n" + "\n".join(f"{d}: {e[:2000]}" for d, e in run.failures)
    assert numbers(run)["mismatches"] == 0
    assert report.ok, f"history check: {report.problems()}"
    assert all(typ == "transition.rejected" and reason for _, typ, reason in run.forged.values()), run.forged
    assert not audit_findings(run, audit), f"audit: {audit_findings(run, audit)}\n{audit}"
