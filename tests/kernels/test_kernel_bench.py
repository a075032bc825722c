"""``python -m bench.kernels`` without CUDA: reference timings only, one JSON object last."""

from __future__ import annotations

import json

from kernel_testing import cpu_only

from bench import kernels as bench


@cpu_only
def test_cpu_run_reports_reference_timings_only(capsys):
    assert bench.main(["--only", "gather_blocks,save_state_csa", "--reps", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["cuda"] is False and "Triton timings need a GPU" in result["note"]
    assert [c["case"] for c in result["cases"]] == ["save_state_csa", "gather_blocks"]
    for c in result["cases"]:
        assert c["reference_ms"] > 0 and "triton_ms" not in c
