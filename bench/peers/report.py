"""guidellm's json report read into per-level figures, and the figures turned into the bench's keys.

Pure functions (no server, no guidellm): what the unit test checks on a captured report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ABSENT = "absent"


@dataclass(frozen=True)
class Level:
    """One guidellm benchmark (one concurrency level) of one server: successful requests only."""

    concurrency: int
    requests_ok: int
    requests_errored: int
    requests_incomplete: int
    output_tps: float      # output tokens per second of the benchmark's wall time (all requests' tokens)
    output_tokens_per_request: float  # mean over successful requests (the workload asks a fixed count)
    ttft_p50_ms: float
    itl_p50_ms: float
    duration_s: float


@dataclass(frozen=True)
class Failed:
    """A level that gave no figure: why (guidellm failing, or every request erroring)."""

    concurrency: int
    reason: str


def _first_error(bench: dict[str, Any]) -> str:
    """The last line of the first errored request's error, as guidellm recorded it."""
    totals = bench["metrics"]["request_totals"]
    if not totals.get("errored") and totals.get("incomplete"):
        return f"none finished within the level's {bench.get('duration', 0):.0f} s"
    for r in (bench.get("requests") or {}).get("errored") or []:
        info = r.get("info") or {}
        err = info.get("error") if isinstance(info, dict) else None
        if err:
            return str(err).strip().splitlines()[-1][:240]
    return "no error text kept"


def _median(metric: dict[str, Any]) -> float:
    """The successful requests' median of one guidellm metric (its ``successful`` distribution)."""
    ok = metric["successful"]
    p50 = (ok.get("percentiles") or {}).get("p50")
    return float(p50 if p50 is not None else ok["median"])


def _streams(bench: dict[str, Any]) -> int:
    """The concurrency a benchmark ran at: its strategy's ``streams``."""
    cfg = bench["config"]
    for holder in (cfg.get("strategy") or {}, cfg.get("profile") or {}, cfg):
        if "streams" in holder:
            s = holder["streams"]
            return int(s[0] if isinstance(s, list) else s)
    raise ValueError("guidellm benchmark without streams (not a concurrent profile?)")


def parse_levels(report: dict[str, Any]) -> list[Level | Failed]:
    """Every benchmark of a guidellm json report (``--output kind=json``), in its order; one without
    a successful request is a :class:`Failed` naming its first error."""
    levels: list[Level | Failed] = []
    for b in report["benchmarks"]:
        m = b["metrics"]
        totals = m["request_totals"]
        ok = int(totals["successful"])
        if ok == 0:
            levels.append(Failed(_streams(b), f"no successful request ({totals.get('errored', 0)} errored, "
                                              f"{totals.get('incomplete', 0)} incomplete): {_first_error(b)}"))
            continue
        levels.append(Level(
            concurrency=_streams(b), requests_ok=ok, requests_errored=int(totals.get("errored", 0)),
            requests_incomplete=int(totals.get("incomplete", 0)),
            # "total": the tokens of requests still running when a max_duration cut the level count too
            output_tps=float(m["output_tokens_per_second"]["total"]["mean"]),
            output_tokens_per_request=float(m["output_token_count"]["successful"]["mean"]),
            ttft_p50_ms=_median(m["time_to_first_token_ms"]), itl_p50_ms=_median(m["inter_token_latency_ms"]),
            duration_s=float(b.get("duration") or 0.0)))
    return levels


def read_levels(path: Path) -> list[Level | Failed]:
    return parse_levels(json.loads(path.read_text()))


Levels = list[Level | Failed]


def level_keys(name: str, levels: Levels, suffix: str = "") -> dict[str, Any]:
    """The absolute figures of one server: ``<name>_output_tps_c<N>``, ``_ttft_p50_ms_c<N>``,
    ``_itl_p50_ms_c<N>``, ``_requests_ok_c<N>``, ``_output_tokens_per_request_c<N>`` (plus
    ``_requests_errored_c<N>`` when any); a failed level is ``<name>_c<N>: "failed: <why>"``."""
    keys: dict[str, Any] = {}
    for lv in levels:
        c = f"c{lv.concurrency}{suffix}"
        if isinstance(lv, Failed):
            keys[f"{name}_{c}"] = f"failed: {lv.reason}"
            continue
        keys[f"{name}_output_tps_{c}"] = round(lv.output_tps, 2)
        keys[f"{name}_ttft_p50_ms_{c}"] = round(lv.ttft_p50_ms, 1)
        keys[f"{name}_itl_p50_ms_{c}"] = round(lv.itl_p50_ms, 2)
        keys[f"{name}_requests_ok_{c}"] = lv.requests_ok
        keys[f"{name}_output_tokens_per_request_{c}"] = round(lv.output_tokens_per_request, 1)
        if lv.requests_errored:
            keys[f"{name}_requests_errored_{c}"] = lv.requests_errored
    return keys


def ratio_keys(peer: str, ours: Levels, theirs: Levels, suffix: str = "") -> dict[str, Any]:
    """kvledger ÷ peer at each level both ran: ``peer_<peer>_throughput_ratio_c<N>`` (output tokens/s:
    above 1 is kvledger faster), ``peer_<peer>_ttft_p50_ratio_c<N>`` and ``_itl_p50_ratio_c<N>``
    (latencies: below 1 is kvledger faster)."""
    by_c = {lv.concurrency: lv for lv in theirs if isinstance(lv, Level)}
    keys: dict[str, Any] = {}
    for lv in ours:
        p = by_c.get(lv.concurrency)
        if p is None or not isinstance(lv, Level):
            continue
        c = f"c{lv.concurrency}{suffix}"
        keys[f"peer_{peer}_throughput_ratio_{c}"] = _ratio(lv.output_tps, p.output_tps)
        keys[f"peer_{peer}_ttft_p50_ratio_{c}"] = _ratio(lv.ttft_p50_ms, p.ttft_p50_ms)
        keys[f"peer_{peer}_itl_p50_ratio_{c}"] = _ratio(lv.itl_p50_ms, p.itl_p50_ms)
    return keys


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def floor_keys(floor_ms: float, levels: dict[str, Levels], suffix: str = "") -> dict[str, Any]:
    """``decode_floor_ms`` and each server's c=1 inter-token latency over it (``itl_c1_vs_floor`` for
    kvledger, ``peer_<name>_itl_c1_vs_floor`` for a peer): how far a decode step is from reading
    the weights once at the machine's measured bandwidth."""
    keys: dict[str, Any] = {f"decode_floor_ms{suffix}": round(floor_ms, 3)}
    for name, lvs in levels.items():
        c1 = next((lv for lv in lvs if isinstance(lv, Level) and lv.concurrency == 1), None)
        if c1 is None or floor_ms <= 0:
            continue
        key = "itl_c1_vs_floor" if name == "kvledger" else f"peer_{name}_itl_c1_vs_floor"
        keys[key + suffix] = round(c1.itl_p50_ms / floor_ms, 2)
    return keys


def dtype_suffix(dtype: str, dtypes: list[str]) -> str:
    """``""`` when one dtype runs, ``_<dtype>`` (``_bf16``, ``_fp32``) when several do."""
    if len(dtypes) == 1:
        return ""
    return "_" + {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def results_keys(dtype: str, dtypes: list[str], results: dict[str, Levels | str],
                 floor_ms: float) -> dict[str, Any]:
    """All keys of one dtype. ``results`` maps a server name (``kvledger``, ``vllm``, ...) to its
    levels, or to a string when it did not run: ``"absent"`` (not installed) or why it failed;
    such a peer gets ``peer_<name>: <that string>`` and no number."""
    sfx = dtype_suffix(dtype, dtypes)
    keys: dict[str, Any] = {}
    ours = results.get("kvledger")
    ran: dict[str, Levels] = {}
    if isinstance(ours, list):
        keys.update(level_keys("kvledger", ours, sfx))
        ran["kvledger"] = ours
    elif ours is not None:
        keys[f"kvledger{sfx}"] = ours
    for name, res in results.items():
        if name == "kvledger":
            continue
        if isinstance(res, str):
            keys[f"peer_{name}{sfx}"] = res
            continue
        ran[name] = res
        keys.update(level_keys(f"peer_{name}", res, sfx))
        if isinstance(ours, list):
            keys.update(ratio_keys(name, ours, res, sfx))
    keys.update(floor_keys(floor_ms, ran, sfx))
    return keys


def cpu_keys(dtype: str, dtypes: list[str], cpu: dict[str, dict[int, dict[str, float]]]) -> dict[str, Any]:
    """Each server's CPU seconds per level: ``<name>_cpu_s_c<N>`` (its whole process tree) and, for
    a server of several processes, ``<name>_cpu_s_<role>_c<N>`` — where the machine's two cores
    went (kvledger's coordinator, gateway, PostgreSQL and NATS take them from its forwards)."""
    sfx = dtype_suffix(dtype, dtypes)
    keys: dict[str, Any] = {}
    for name, levels in cpu.items():
        label = name if name == "kvledger" else f"peer_{name}"
        for c, roles in levels.items():
            keys[f"{label}_cpu_s_c{c}{sfx}"] = round(sum(roles.values()), 1)
            if len(roles) > 1:
                keys.update({f"{label}_cpu_s_{role}_c{c}{sfx}": round(s, 1) for role, s in sorted(roles.items())})
    return keys

