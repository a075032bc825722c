"""bench.core_instructions: each workload runs its real core path in a child process, and the
parent refuses what it cannot measure."""

from __future__ import annotations

import pytest

from bench.core_instructions import WORKLOADS, fold_workload, ingest_workload, lease_workload, main


def test_every_workload_runs_in_a_child_and_reports_its_unit(capsys) -> None:
    out = main(["--quick", "--no-valgrind"])
    assert out is not None and out["counted_by"] == "none"
    for w, unit in (("fold", "event"), ("ingest", "transition"), ("lease", "acquire")):
        assert out[f"{w}_units"] > 0 and out[f"{w}_us_per_{unit}"] > 0
        assert f"{w}_instructions_per_{unit}" not in out       # only callgrind counts instructions
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"bench": "core_instructions"')


def test_the_workloads_do_what_they_say() -> None:
    from coordinator.core import check_invariants

    work, n = fold_workload(600)
    rows = dict(zip(work.__code__.co_freevars, (c.cell_contents for c in work.__closure__)))["rows"]
    assert [p for p, _ in rows] == list(range(1, 601))   # the log's positions, as a replay reads them
    state = work()
    assert n == 600 and state.applied == 600 and check_invariants(state) == []
    assert not state.indexes_deferred and sum(map(len, state.lru.values())) > 0   # rebuilt at the end
    work, n = ingest_workload(512)
    assert n == 512 and len(work()) == 512      # every transition applied (the workload checks its type)
    work, n = lease_workload(50)
    assert work() == n == 50                    # every acquire a grant that evicted 4


@pytest.mark.parametrize("argv", [["--workloads", "fold,nope"], ["--workloads", ","], ["--repo", "/"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)


def test_without_valgrind_the_bench_says_how_to_get_it(monkeypatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="valgrind is not installed"):
        main(["--quick", "--workloads", "fold"])
    assert set(WORKLOADS) == {"fold", "ingest", "lease"}
