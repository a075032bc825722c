"""The summary of a run of drills: a few lines for the terminal, a section for docs/RELIABILITY.md."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.faults.drills import Run


def unexplained(run: Run, audit: dict[str, Any]) -> dict[str, Any]:
    from tests.faults.drills import audit_findings
    return audit_findings(run, audit)

HEADER = """# Reliability: fault drills and differential correctness

The claim under test: **no wrong answer and no lost event, whatever fails.** `tests/faults`
drives the real stack while faults are injected, then checks the whole history. Each section
below is one real run, written by the run itself (`KVL_WRITE_RELIABILITY=1`).

* **Stack**: embedded PostgreSQL and nats-server owned by the test (so they can be killed),
  a coordinator process (and, in the takeover drill, a standby coordinator following the log),
  four worker processes — `wa` and `wb` with small pools that spill to a shared offload
  directory (`wa` straight to disk, `wb` through a small host tier), `wp` with a 2-slot `tail`
  pool, `wr` the untouched retention witness — the tiny seeded model on CPU
  (`KVL_DRILL_MODEL_DIR=DIR` runs the same drills on a checkpoint directory instead, e.g. a
  Llama as transformers saves it; `wp` then gets a whole pool of 2 blocks;
  `KVL_DRILL_RESTORE_IN_PLACE=always` makes such a model's workers read every hit in place). Each process is its
  own NATS user confined to its own subjects (as `kvledger up` runs them); the witness listens as
  `observer`, the debug channel asks as `operator`, and a forgery is sent as the worker it names.
* **Load**: multi-turn conversations, each turn = previous prompt + previous answer + new
  tokens, greedy, over the OpenAI HTTP API (token-id prompts) and the workers' NATS debug
  subject (token ids and logits), with bounded retries after errors; each drill uses its own
  tenant, so it starts cold and builds reuse turn by turn.
* **Differential check**: every answer is compared with the same request run cold on a
  cache-disabled engine (`Engine(model, cfg, client=None)`: same weights, same prefill
  schedule, one thread): token ids and logits bit for bit on the debug channel; on HTTP the
  text and the token counts, which pins the token ids whenever the text has no replacement
  character (the byte tokenizer is then injective). Zero mismatches allowed; a request may fail
  only with an error of a kind its fault explains, counted by kind.
* **History check** (Jepsen queue style, `tests/faults/checker.py`): a passive NATS observer
  records every transition published and every commit watermark announced; at the end the
  whole log (`GET /v1/events`) is checked per (worker, epoch, seq): acknowledged ⊆ logged
  (nothing *lost*), no source id twice (*duplicated*), nothing logged unlike what was published
  (*unexpected*). An independent fold of the replica life cycle (architecture.md) checks that every
  applied transition was legal, every lease pinned READY replicas it could read at the pinned
  generation, and no GPU/host replica of a fenced epoch was pinned. Four illegal transitions
  are forged on JetStream at the end and must be in the log once each, rejected with a reason.
  Then `POST /v1/audit` (replay from empty; every worker's GPU and host tiers against its
  inventory; a sample of disk files verified) must find nothing the run does not explain: on
  disk, the files the offload drills removed or damaged on purpose (and it must find those);
  nothing on a GPU or host tier.
* **Recovery**: seconds from the injection until a worker answers a request *with reuse*
  again (probes poll every 0.2 s from the moment of injection); "ready" is until the restarted
  part answered its readiness probe (workers: registered, not degraded).
* **Cache retained** (control-plane drills): `wr`, a worker the load never touches, holds four
  6-block prompts warmed just before the fault; once `wr` and the ledger agree it is back (ready,
  epoch not suspended), each is sent once more: cached tokens of that first resend ÷ before the
  fault. Goal ≥ 99 % for every fault shorter than the resume grace period (15 s here), 0 % (the
  fence) for a stall past it and for a worker kill -9. Two forged resumes (a fenced epoch, an
  unknown worker) must be refused and logged.

Reproduce: `make test` runs one pass of every drill (`tests/faults/test_drills.py`, 1.5–3
minutes on 2 shared cores); `pytest tests/faults --soak` (or `KVL_SOAK=1` with any pytest
command) adds the soak (`KVL_SOAK_CYCLES` cycles of every drill in a shuffled order, six
conversations of five turns, longer outages); `KVL_WRITE_RELIABILITY=1` rewrites this file.

Finding, fixed (no wrong answer, no lost event): the first soak found a worker's host tier
dropping replicas that a live lease pinned; the ledger refused the eviction and kept listing
the replica READY, so a later lease pinned bytes that were gone and that request's hit
validation failed at its presence layer (it recomputed). Since 2026-12-01 the host tier's LRU
skips pinned entries, and since 2026-12-02 a host victim's bytes go only after the coordinator
evicted it (architecture.md, "The tiers below the GPU: host memory and segment files").
`tests/faults/test_host_tier_pins.py` keeps the reduced case as a regression test, and the
audit's host-tier comparison excuses nothing.

Finding (no wrong answer, cache kept): after a coordinator stall, reuse of the prompts whose
lease requests were in flight at the stop comes back only after `lease_ttl_ms` (8 s here): the
stopped coordinator still grants those requests when it wakes, after their senders gave up and
recomputed, and nobody releases the orphaned grants, whose write reservations keep the blocks
ALLOCATED until they expire. Hence `coordinator-stall`'s recovery ≈ stall + lease TTL, while
retention is 100 %.
"""


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), timeout=5).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _kinds(c: dict[str, int] | Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])) or "none"


def numbers(run: Run) -> dict[str, Any]:
    """The run's headline figures (also what the tests assert on)."""
    recs = run.history.records
    load = [r for r in recs if r.conv >= 0]
    ok = [r for r in recs if r.ok]
    span = (max(r.at + r.seconds for r in recs) - min(r.at for r in recs)) if recs else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "requests": len(recs), "answered": len(ok), "load_requests": len(load),
        "probe_requests": sum(1 for r in recs if r.conv == -1),
        "seconds": round(span, 1), "answered_per_s": round(len(ok) / span, 2) if span else 0.0,
        "p50_s": round(_pct([r.seconds for r in ok], 0.5), 3), "p95_s": round(_pct([r.seconds for r in ok], 0.95), 3),
        "reused_requests": sum(1 for r in ok if r.cached_tokens > 0),
        "reused_token_share": round(cached / prompt, 3) if prompt else 0.0,
        "compared": dict(Counter(r.compared for r in ok)),
        "mismatches": len(run.history.mismatches()),
        "invalid_by_layer": dict(Counter(x.split(":", 1)[0] for r in ok for x in r.invalid)),
        "errors": dict(Counter(r.error for r in recs if not r.ok)),
        "load_errors": dict(Counter(r.error for r in load if not r.ok)),
        "conversations": run.settings.conversations, "turns": run.settings.turns,
        "faults": len(run.faults),
        # the conversation routed by the gateway: how many of its turns, on how many workers, errors
        "gateway_requests": sum(1 for r in recs if r.channel == "gateway"),
        "gateway_workers": len({r.worker for r in recs if r.channel == "gateway" and r.ok}),
        "gateway_errors": dict(Counter(r.error for r in recs if r.channel == "gateway" and not r.ok)),
    }


def terminal(run: Run, title: str) -> str:
    n = numbers(run)
    rep = run.report.summary() if run.report else {}
    lines = [f"{title}: {n['faults']} faults injected; {n['answered']}/{n['requests']} requests answered "
             f"({n['answered_per_s']}/s over {n['seconds']}s; {n['reused_requests']} with reuse); "
             f"mismatches {n['mismatches']} (compared: {_kinds(n['compared'])})",
             f"  errors by kind: {_kinds(n['errors'])}",
             f"  through the gateway: {n['gateway_requests']} requests on {n['gateway_workers']} workers, errors "
             f"{_kinds(n['gateway_errors'])}"]
    if rep:
        lines.append(f"  events checked {rep['events']}: transitions {rep['transitions_logged']} (applied "
                     f"{rep['applied']}, rejected {rep['rejected']}), acknowledged {rep['acknowledged']}, lost "
                     f"{rep['lost']}, duplicated {rep['duplicated']}, unexpected {rep['unexpected']}, illegal "
                     f"{rep['illegal']}, fenced reuse {rep['fenced_reuse']}; audit "
                     f"{'clean' if run.audit and run.audit.get('ok') else 'clean but for what the run explains' if run.audit and not unexplained(run, run.audit) else 'NOT clean'}")
    if run.forged:
        held = Counter(typ for _, typ, _ in run.forged.values())
        lines.append(f"  forged illegal transitions: {len(run.forged)}, in the log as {_kinds(held)}")
    for f in run.faults:
        kept = "" if f.retained_pct is None else f"  retained {f.retained_pct:g}%"
        lines.append(f"  {f.drill:<28} ready {_s(f.ready_s):>6}  recovery {_s(f.recovery_s):>6}{kept}  requests "
                     f"{f.requests:>4}  mismatches {f.mismatches}  errors {_kinds(f.errors)}"
                     + (f"  [NOT EXERCISED: {f.not_exercised}]" if f.not_exercised else ""))
    for name, err in run.failures:
        lines.append(f"  {name}: FAILED: {err.splitlines()[0][:200]}")
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}s"


def _evidence(ev: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {fmt(x)}" for k, x in v.items()) + "}"
        return str(v)
    return "; ".join(f"{k}: {fmt(v)}" for k, v in ev.items())


def section(run: Run, title: str, command: str) -> str:
    n = numbers(run)
    rep = run.report.summary() if run.report else None
    audit = run.audit or {}
    out = [f"## {title}", "",
           f"`{command}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {_git()}, "
           f"{os.cpu_count()} CPU cores shared with other work, Python {platform.python_version()}; "
           f"stack started in {run.started_s:.0f} s (references computed meanwhile: {run.reference.computed}).", "",
           "| | |", "|---|---|",
           f"| load held | {n['conversations']} conversations × {n['turns']} turns per drill, run over and over "
           f"through each fault on both channels, plus recovery probes and the drills' own requests: "
           f"**{n['answered']} of {n['requests']} requests answered** in {n['seconds']} s "
           f"({n['answered_per_s']}/s; p50 {n['p50_s']} s, p95 {n['p95_s']} s); {n['reused_requests']} answered "
           f"with reuse, {n['reused_token_share']:.0%} of answered prompt tokens restored from cache |",
           f"| faults injected | {n['faults']} ({', '.join(f.drill for f in run.faults)}) |"]
    if rep:
        out.append(f"| events checked | {rep['events']} log events; {rep['transitions_logged']} worker transitions "
                   f"({rep['applied']} applied, {rep['rejected']} rejected) against {rep['published']} published "
                   f"({rep['republished']} re-sends) and {rep['acknowledged']} acknowledged: **lost {rep['lost']}, "
                   f"duplicated {rep['duplicated']}, unexpected {rep['unexpected']}**; unknown {rep['unknown']}, "
                   f"recovered {rep['recovered']}, unobserved {rep['unobserved']}; {rep['grants']} grants with "
                   f"{rep['pins_checked']} pins checked: **illegal {rep['illegal']}, fenced reuse "
                   f"{rep['fenced_reuse']}**, position gaps {rep['gaps']}; {rep['registrations']} registrations, "
                   f"{rep['workers_lost']} epochs fenced, {rep['suspensions']} suspended and {rep['resumes']} "
                   "resumed |")
    tiers: Counter[str] = Counter()
    for d in (audit.get("drift") or {}).values():
        for loc, t in (d.get("tiers") or {}).items():
            tiers[f"{loc} ledger-only"] += t.get("ledger_only", 0)
            tiers[f"{loc} worker-only"] += t.get("worker_only", 0)
    disk = audit.get("disk") or {}
    verdict = ("**clean**" if audit.get("ok") else
               "**clean but for what the run explains**" if not unexplained(run, audit) else "**NOT clean**")
    out.append(f"| audit (every tier) | {verdict}: hash match {audit.get('hash_match')}, "
               f"{audit.get('replayed_events')} events replayed from empty, invariant violations "
               f"{len(audit.get('invariant_violations') or [])}; GPU and host tiers of {audit.get('workers_checked')} "
               f"against their inventories: {_kinds(+tiers)}; disk: {disk.get('checked', 0)} of "
               f"{disk.get('ledger_ready', 0)} READY files verified by {disk.get('worker', '—')}, missing "
               f"{(disk.get('missing') or {}).get('count', 0)}, damaged {(disk.get('damaged') or {}).get('count', 0)} "
               "(the offload drills remove and damage files on purpose) |")
    out.append(f"| mismatches | **{n['mismatches']}** of {n['answered']} answers "
               f"(compared: {_kinds(n['compared'])}); replicas that failed hit validation on the way, by layer: "
               f"{_kinds(n['invalid_by_layer'])} (each recomputed) |")
    out.append(f"| errors by kind | {_kinds(n['errors'])} (of which the conversations' own: "
               f"{_kinds(n['load_errors'])}; the rest are recovery probes polling a part that was down, and "
               f"the spike's refusals) |")
    out.append(f"| through the gateway | {n['gateway_requests']} requests (one conversation of every drill's load, each turn `n` = 2 forked samples), "
               f"served by {n['gateway_workers']} workers; errors: {_kinds(n['gateway_errors'])} |")
    out += ["", "| drill | injected | requests | errors by kind | mismatches | ready after | recovery (first reuse) "
            "| cache retained | evidence |", "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for f in run.faults:
        ev = _evidence(f.evidence) + (f" **Not exercised:** {f.not_exercised}" if f.not_exercised else "")
        kept = "—" if f.retained_pct is None else f"{f.retained_pct:g} %"
        out.append(f"| {f.drill} | {f.injected} | {f.requests} | {_kinds(f.errors)} | {f.mismatches} | "
                   f"{_s(f.ready_s)} | {_s(f.recovery_s)} | {kept} | {ev} |")
    if run.failures:
        out += ["", "Drills that failed:", ""]
        out += [f"* `{name}`: {err.splitlines()[0][:300]}" for name, err in run.failures]
    if rep and rep["rejected_by_reason"]:
        out += ["", "Transitions the coordinator rejected (recorded with their reason; each changed nothing): "
                + _kinds(rep["rejected_by_reason"]) + "."]
    if run.host_drift:
        out += ["", "Host tiers against the ledger at the end (counted by the drills; the audit compares them too): "
                + "; ".join(f"{w}: ledger {d['ledger']} READY, worker {d['worker']}, only in the ledger "
                            f"{d['ledger_only']}, only on the worker {d['worker_only']}"
                            for w, d in run.host_drift.items()) + "."]
    if any(sum(d.values()) for d in run.pool_room.values()):
        out += ["", "Granted writes a full GPU pool refused (the worker's and the ledger's views diverged; each "
                "write aborted, room asked of the coordinator) since each worker's last start: "
                + "; ".join(f"{w}: {d['refused_writes']} refused, victims evicted {d['evicted']}, pinned "
                            f"{d['pinned']}, deferred {d['deferred']}" for w, d in run.pool_room.items()
                            if sum(d.values())) + "."]
    if run.forged_resumes:
        out += ["", "Resumes forged at the end: " + "; ".join(f"{why}: {code}, {seen}"
                                                         for why, (code, seen) in run.forged_resumes.items()) + "."]
    if run.forged:
        out += ["", "Illegal transitions published on purpose at the end (JetStream, as a confused or stale "
                "worker would), and how the log holds them:", "",
                "| source id | what is wrong | in the log | reason recorded |", "|---|---|---|---|"]
        out += [f"| `{sid}` | {why} | {typ} | {reason[:120]} |" for sid, (why, typ, reason) in run.forged.items()]
    return "\n".join(out) + "\n"


def document(sections: list[str]) -> str:
    return HEADER + "\n" + "\n".join(sections)


def publish(run: Run, title: str, command: str) -> None:
    from tests.faults.conftest import REPORTS

    REPORTS.append((terminal(run, title), section(run, title, command)))


__all__ = ["document", "numbers", "publish", "section", "terminal"]
