"""bench.peers without any peer installed: guidellm's json read into figures and keys, absent peers
reported as absent, the decode floor's arithmetic.

Two real guidellm 0.8.1 reports of the bench's workload on this project's 2-core machine under
load, trimmed (per-request records and the text/turn metrics removed): guidellm_0.8.1_vllm_c2.json
(vLLM's CPU build, 2 streams, 6 requests, 60 s cap) and guidellm_0.8.1_kvledger_c8_timeout.json
(``kvledger up`` at 8 streams: every request past the worker's 60 s request timeout; one errored
request's error kept)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from bench.peers import floor
from bench.peers.__main__ import parse
from bench.peers.load import Workload, guidellm_command, requests_at
from bench.peers.report import Failed, Level, dtype_suffix, parse_levels, read_levels, results_keys
from bench.peers.servers import installed

REPORT = Path(__file__).parent / "data" / "guidellm_0.8.1_vllm_c2.json"
TIMEOUT_REPORT = Path(__file__).parent / "data" / "guidellm_0.8.1_kvledger_c8_timeout.json"


def test_a_real_guidellm_report_is_read_as_its_console_table_shows_it() -> None:
    [lv] = read_levels(REPORT)
    # guidellm's own table for this run: TTFT Mdn 5776.1 ms, ITL Mdn 480.3 ms, 3.0 output tok/s
    assert lv.concurrency == 2
    assert (lv.requests_ok, lv.requests_errored, lv.requests_incomplete) == (4, 0, 2)
    assert lv.ttft_p50_ms == pytest.approx(5776.1, abs=0.1)
    assert lv.itl_p50_ms == pytest.approx(480.3, abs=0.1)
    assert lv.output_tps == pytest.approx(2.98, abs=0.01)
    assert lv.output_tokens_per_request == 32.0 and lv.duration_s == 60.0


def _level(c: int, tps: float, ttft: float, itl: float) -> Level:
    return Level(c, 10, 0, 0, tps, 32.0, ttft, itl, 60.0)


def test_ratios_are_kvledger_over_the_peer_at_each_level_both_ran() -> None:
    ours = [_level(1, 40.0, 100.0, 20.0), _level(8, 200.0, 300.0, 30.0)]
    theirs = [_level(1, 20.0, 50.0, 40.0), _level(8, 400.0, 600.0, 30.0), _level(32, 1.0, 1.0, 1.0)]
    keys = results_keys("float32", ["float32"], {"kvledger": ours, "vllm": theirs}, floor_ms=10.0)
    assert keys["peer_vllm_throughput_ratio_c1"] == 2.0 and keys["peer_vllm_throughput_ratio_c8"] == 0.5
    assert keys["peer_vllm_ttft_p50_ratio_c1"] == 2.0 and keys["peer_vllm_itl_p50_ratio_c1"] == 0.5
    assert keys["peer_vllm_itl_p50_ratio_c8"] == 1.0
    assert "peer_vllm_throughput_ratio_c32" not in keys and keys["peer_vllm_output_tps_c32"] == 1.0
    assert keys["kvledger_output_tps_c1"] == 40.0 and keys["peer_vllm_itl_p50_ms_c8"] == 30.0
    assert keys["decode_floor_ms"] == 10.0
    assert keys["itl_c1_vs_floor"] == 2.0 and keys["peer_vllm_itl_c1_vs_floor"] == 4.0


def test_an_absent_or_failed_peer_is_a_word_never_a_number() -> None:
    ours = [_level(1, 40.0, 100.0, 20.0)]
    keys = results_keys("bfloat16", ["float32", "bfloat16"],
                        {"kvledger": ours, "llamacpp": "absent", "transformers": "failed: 422"}, floor_ms=5.0)
    assert keys["peer_llamacpp_bf16"] == "absent" and keys["peer_transformers_bf16"] == "failed: 422"
    assert not [k for k in keys if k.startswith(("peer_llamacpp_", "peer_transformers_")) and k[-5:] != "_bf16"]
    assert not [k for k in keys if "ratio" in k]
    assert keys["kvledger_output_tps_c1_bf16"] == 40.0 and keys["itl_c1_vs_floor_bf16"] == 4.0


def test_a_peer_whose_venv_is_not_ready_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVL_PEERS_DIR", str(tmp_path))
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "python").touch()
    assert installed("vllm") is None          # setup.sh did not finish: no marker
    (tmp_path / "vllm" / ".kvl-peer-ready").write_text("0.32.0\n")
    assert installed("vllm") == tmp_path / "vllm"
    assert installed("llamacpp") is None


def test_a_level_without_one_successful_request_is_a_failure_naming_its_first_error() -> None:
    [lv] = read_levels(TIMEOUT_REPORT)
    assert isinstance(lv, Failed) and lv.concurrency == 8
    assert lv.reason.startswith("no successful request (8 errored, 0 incomplete): ValueError('Streaming response")
    assert "service.request_timeout_ms (60000 ms)" in lv.reason
    keys = results_keys("float32", ["float32"], {"kvledger": [lv], "vllm": read_levels(REPORT)}, floor_ms=10.0)
    assert keys["kvledger_c8"].startswith("failed: no successful request")
    assert not [k for k in keys if k.startswith("kvledger_") and k != "kvledger_c8"]
    assert not [k for k in keys if "ratio" in k] and "itl_c1_vs_floor" not in keys
    assert keys["peer_vllm_output_tps_c2"] == pytest.approx(2.98, abs=0.01)


def test_a_level_cut_by_its_cap_before_any_request_finished_says_so() -> None:
    cut = copy.deepcopy(json.loads(REPORT.read_text()))
    cut["benchmarks"][0]["metrics"]["request_totals"].update(successful=0, errored=0, incomplete=6)
    [lv] = parse_levels(cut)
    assert isinstance(lv, Failed) and lv.reason.endswith("none finished within the level's 60 s")


def test_the_dtype_suffix_appears_only_when_several_dtypes_run() -> None:
    assert dtype_suffix("float32", ["float32"]) == ""
    assert dtype_suffix("float32", ["float32", "bfloat16"]) == "_fp32"
    assert dtype_suffix("bfloat16", ["float32", "bfloat16"]) == "_bf16"


def test_the_guidellm_command_carries_the_workload_and_the_level() -> None:
    cmd = guidellm_command(Path("/g"), "http://127.0.0.1:1", "smol", Path("/m"), 8, 48, 90, seed=1008,
                           out=Path("/o.json"))
    joined = " ".join(cmd)
    assert "kind=concurrent,streams=8" in joined and "kind=max_requests,count=48" in joined
    assert "turns=3" in joined and "prefix_tokens=512" in joined and "output_tokens=32" in joined
    assert "target=http://127.0.0.1:1,model=smol,request_format=/v1/chat/completions" in joined and "kind=static,value=1008" in joined
    assert requests_at(8, quick=True) == 8 * Workload().turns and requests_at(32, quick=False) == 192
    assert requests_at(1, quick=True) == 9 and requests_at(1, quick=False) == 24


def test_quick_defaults_and_bad_arguments() -> None:
    a = parse(["--quick"])
    assert a.concurrency == [1, 8] and a.dtypes == ["float32"] and a.peers == ["vllm", "transformers", "llamacpp"]
    assert parse([]).dtypes == ["float32", "bfloat16"] and parse([]).concurrency == [1, 8, 32]
    with pytest.raises(SystemExit):
        parse(["--peers", "sglang"])
    with pytest.raises(SystemExit):
        parse(["--dtypes", "int8"])


def test_weight_bytes_come_from_the_safetensors_headers(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(10, 3), "b": torch.zeros(7, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    assert floor.weight_bytes(tmp_path) == 10 * 3 * 4 + 7 * 2
    assert floor.floor_ms(2_000_000_000, 10.0) == pytest.approx(200.0)


def test_a_servers_cpu_is_counted_over_its_whole_tree_by_role() -> None:
    import subprocess
    import sys
    import time

    from bench.proc_cpu import tree_cpu, tree_spent
    from bench.peers.report import cpu_keys

    # a parent whose child burns CPU: the child's seconds count under the parent's tree
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {spin!r}])\ntime.sleep(30)"])
    try:
        before = tree_cpu(parent.pid)
        time.sleep(1.5)
        spent = tree_spent(before, tree_cpu(parent.pid))
        assert sum(spent.values()) >= 0.25, spent
    finally:
        for line in subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split():
            subprocess.run(["kill", line])
        parent.kill()
        parent.wait()
    keys = cpu_keys("float32", ["float32"], {"kvledger": {8: {"worker": 40.0, "coordinator": 3.04}},
                                             "vllm": {8: {"engine": 50.0}}})
    assert keys == {"kvledger_cpu_s_c8": 43.0, "kvledger_cpu_s_coordinator_c8": 3.0, "kvledger_cpu_s_worker_c8": 40.0,
                    "peer_vllm_cpu_s_c8": 50.0}
