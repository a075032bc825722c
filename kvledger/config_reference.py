"""The reference sections of docs/operations.md, generated so they cannot drift from the code.

* **configuration**: every key of :class:`shared.config.Config` — type and bounds from the
  schema, default from the schema, its environment variable, and the description written
  beside the field in ``shared/config.py`` (``#:`` comments) or in :data:`EXTRA`
  (``kvledger.example.yaml`` is generated from the same, by :mod:`kvledger.config_example`);
* **metrics**: every Prometheus metric the coordinator and the worker export, from their
  registries (name, type, labels, help).

``python -m kvledger.config_reference`` prints both; ``--write docs/operations.md`` replaces
the text between the ``<!-- generated:NAME -->`` / ``<!-- /generated:NAME -->`` markers; a unit
test fails when the document is out of date.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from shared.config import Config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "kvledger.example.yaml"
SHORT_ENV = {"database.url": "KVL_DATABASE_URL", "nats.url": "KVL_NATS_URL"}

#: The modules that define the sections of :class:`shared.config.Config` (shared/config.py re-exports
#: the others' sections): their ``#:`` comments describe the keys, their sections' docstrings head them.
SECTION_MODULES = ("shared.config", "shared.config_types", "shared.config_worker", "shared.config_gateway")

#: Descriptions for keys that have no comment in shared/config.py (or whose comment there is not
#: a description). A test requires every key to have one.
EXTRA = {
    "cache.block_size": "Tokens per block; must be a multiple of every compress ratio.",
    "cache.offload_dir": "The shared disk tier (e.g. /data/cache_offload); empty = no disk tier.",
    "cache.hit_validation.check_offload": "Anything reloaded from the host or disk tier is checksummed when true.",
    "cache.on_invalid": "`refill` = recompute from the first unusable block; `error` = fail the request.",
    "service.max_context_length": "Prompt + max_tokens above this is a 400, never a silent truncation.",
    "service.cache_reserve_ratio": "Share of the pools' memory (`worker.pool_bytes`, or sized from memory) given to cached forms.",
    "coordinator.port": "Port of the admin REST API (and /metrics, /ui).",
    "worker.port": "Port of the OpenAI-compatible API (0 = any free port).",
    "logging.format": "`json` (one object per line), `console`, or `auto` (console on a terminal, else json).",
    "cache.compressed_pool_limit": "Share of the cache budget for the full-history forms (compressed entries "
                                   "and indexer keys, equal slot counts); the three limits sum to ≤ 1.0.",
    "cache.tail_pool_limit": "Share of the cache budget for the resume-point form (compressor tail).",
    "cache.swa_pool_limit": "Share of the cache budget for the sliding-window form.",
    "cache.hit_validation.check_compressed": "Validate reused `compressed` replicas before a kernel reads them.",
    "cache.hit_validation.check_tail": "Validate reused `tail` replicas.",
    "cache.hit_validation.check_swa": "Validate reused `swa` replicas.",
    "cache.hit_validation.check_indexer": "Validate reused `indexer` replicas.",
    "service.max_concurrency": "Requests a worker runs at once (more wait in the queue).",
    "service.batch_window_ms": ("How long a request arriving at a busy worker waits for others, so that the highest "
                                "priority among them is admitted first and their prompts share forwards; at an idle "
                                "worker a request starts at once."),
    "service.request_timeout_ms": "A request running longer is cancelled (its leases released).",
    "service.queue_size": "Requests that may wait for admission; beyond it a request is refused (429).",
    "service.queue_timeout_ms": "A request waiting longer for admission is refused.",
    "service.max_body_bytes": "Largest HTTP request body the worker accepts (413 above).",
    "database.pool_size": "Connections the coordinator keeps to PostgreSQL.",
    "database.connect_timeout_ms": "Bound on connecting and on lock waits; statements get twice this (≥ 5 s).",
    "nats.subject_prefix": "Prefix of every NATS subject and of the JetStream stream; separate deployments "
                           "on one NATS server need distinct prefixes.",
    "nats.request_timeout_ms": "Timeout of every worker → coordinator request (lease, register, heartbeat).",
    "nats.stream_max_age_s": "JetStream keeps transitions at most this long (they are committed within "
                             "milliseconds normally).",
    "coordinator.host": "Admin REST API address; a non-loopback address needs an admin token.",
    "coordinator.lease_ttl_ms": "A lease not renewed within this time expires (its pins and write "
                                "reservations are released).",
    "coordinator.heartbeat_interval_ms": "How often workers heartbeat.",
    "coordinator.resume_grace_ms": "A worker silent for `missed_heartbeats` intervals is suspended, its cache "
                                   "kept for it; one that resumes within this time keeps its epoch and cache, "
                                   "one that does not is fenced (its GPU/host replicas LOST). At least "
                                   "`lease_ttl_ms`.",
    "coordinator.commit_batch_max": "Most events in one group-commit transaction.",
    "coordinator.snapshot_every_events": "Save a snapshot of the state after this many events (replay after a "
                                         "restart starts from the latest one).",
    "worker.worker_id": "The worker's id in the ledger and in NATS subjects; empty = `<hostname>-<pid>`.",
    "worker.host": "OpenAI-compatible API address.",
    "worker.outbox_max": "Transitions a worker keeps until the coordinator's watermark covers them; when "
                         "full the worker serves degraded (no caching) until it drains.",
    "worker.outbox_resend_ms": "Transitions not covered by the watermark after this long are published again.",
    "auth.keys": "API keys: a list of `{key_sha256, tenant, max_concurrency, cache_quota_blocks, "
                 "requests_per_second, tokens_per_minute, priority}` (keys are stored only as sha256; "
                 "requests_per_second and tokens_per_minute are the gateway's rate limits, 0 = none; priority is "
                 "the tenant's scheduling priority, which a request may only lower).",
    "logging.level": "Least severe level written.",
}


def _field_comments() -> dict[tuple[str, str], str]:
    """``(class name, field) -> text`` of the ``#:`` lines just above a field in shared/config.py
    and in the modules whose sections it re-exports (:data:`SECTION_MODULES`)."""
    out: dict[tuple[str, str], str] = {}
    for name in SECTION_MODULES:
        out.update(_comments_in(Path(importlib.import_module(name).__file__ or "").read_text()))
    return out


def _comments_in(source: str) -> dict[tuple[str, str], str]:
    """``(class name, field) -> text`` of the ``#:`` lines just above a field in ``source``."""
    lines = source.splitlines()
    out: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                doc: list[str] = []
                i = item.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#:"):
                    doc.insert(0, lines[i].strip()[2:].strip())
                    i -= 1
                if doc:
                    out[(node.name, item.target.id)] = " ".join(doc)
    return out


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(t)
        bounds = []
        for m in meta:
            if isinstance(m, msgspec.Meta):
                for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                    v = getattr(m, attr, None)
                    if v is not None:
                        bounds.append(f"{sym} {v}")
                if getattr(m, "pattern", None):
                    bounds.append("pattern")
        return _type_name(base) + (f" ({', '.join(bounds)})" if bounds else "")
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(t):
        return " or ".join(_type_name(a) for a in typing.get_args(t) if a is not type(None)) + " or unset"
    if origin is list:
        (inner,) = typing.get_args(t)
        return f"list of {_type_name(inner)}"
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return t.__name__
    return getattr(t, "__name__", str(t))


def _default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


def _fmt_default(v: Any) -> str:
    if v is msgspec.NODEFAULT:
        return "(required)"
    if v is None:
        return "(unset)"
    if v == "":
        return '`""`'
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, list):
        return f"`[{', '.join(map(str, v))}]`" if v else "`[]`"
    if isinstance(v, dict) and not v:
        return "`{}`"
    return f"`{v}`"


def descriptions() -> dict[str, str]:
    """``dotted key -> description`` of every leaf key that has one (:data:`EXTRA`, else ``#:``)."""
    docs = _field_comments()
    out: dict[str, str] = {}

    def walk(struct: type[msgspec.Struct], path: list[str]) -> None:
        for f in msgspec.structs.fields(struct):
            if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
                walk(f.type, [*path, f.name])
                continue
            dotted = ".".join([*path, f.name])
            desc = EXTRA.get(dotted) or docs.get((struct.__name__, f.name))
            if desc:
                out[dotted] = desc
    walk(Config, [])
    return out


def config_rows() -> list[dict[str, str]]:
    """One row per leaf key, in schema order."""
    described = descriptions()
    rows: list[dict[str, str]] = []

    def walk(struct: type[msgspec.Struct], path: list[str]) -> None:
        for f in msgspec.structs.fields(struct):
            t = f.type
            if isinstance(t, type) and issubclass(t, msgspec.Struct) and t.__name__ != "ApiKey":
                walk(t, [*path, f.name])
                continue
            dotted = ".".join([*path, f.name])
            env = "KVL_" + "__".join(p.upper() for p in [*path, f.name]) if path else "(config file only)"
            if dotted in SHORT_ENV:
                env = f"{SHORT_ENV[dotted]}, {env}"
            desc = described.get(dotted, "")
            desc = desc.replace("``", "`").replace("|", "\\|")
            rows.append({"key": dotted, "type": _type_name(t), "default": _fmt_default(_default(f)),
                         "env": env, "description": desc})
    walk(Config, [])
    return rows


def config_markdown() -> str:
    out = ["| key | type | default | environment | description |", "|---|---|---|---|---|"]
    for r in config_rows():
        env = ", ".join(f"`{e}`" if e.startswith("KVL_") else e for e in r["env"].split(", "))
        out.append(f"| `{r['key']}` | {r['type']} | {r['default']} | {env} | {r['description']} |")
    return "\n".join(out)


def metric_rows() -> list[dict[str, str]]:
    from coordinator.log.chain_metrics import ChainHeadCollector
    from coordinator.metrics import CoordinatorMetrics
    from gateway.app import GatewayMetrics
    from worker.metrics import GpuMemory, WorkerMetrics
    from worker.scheduler import ServingMetrics
    from worker.structured import GrammarMetrics

    cm = CoordinatorMetrics()
    cm.watch_pools(lambda: [("w", "f", 0, 0)])
    cm.watch_workers(lambda: {"live": 0})
    cm.watch_append_paths(lambda: {"copy": 0})
    cm.registry.register(ChainHeadCollector(lambda: (1, bytes(32))))
    wm = WorkerMetrics()
    ServingMetrics.of(wm.registry)
    GrammarMetrics.of(wm.registry)
    # a worker on CUDA has these too (none on CPU, where this runs): listed from a stand-in device
    wm.watch_gpu("cuda:0", 0, read=lambda _: GpuMemory(0, 0, 0, 0))
    rows = []
    for service, registry in (("coordinator", cm.registry), ("worker", wm.registry),
                              ("gateway", GatewayMetrics().registry)):
        for fam in registry.collect():
            labels = sorted({k for s in fam.samples for k in s.labels if k != "le"})
            if not fam.samples:  # a labelled family with no child yet: ask the collector's own definition
                labels = sorted(getattr(_find(registry, fam.name), "_labelnames", ()))
            name = fam.name + ("_total" if fam.type == "counter" else "")
            rows.append({"service": service, "name": name, "type": fam.type, "labels": ", ".join(labels),
                         "help": fam.documentation})
    return sorted(rows, key=lambda r: (r["service"], r["name"]))


def _find(registry: Any, name: str) -> Any:
    for collector, names in registry._collector_to_names.items():  # noqa: SLF001 - a label list, read-only
        if name in names or f"{name}_total" in names:
            return collector
    return None


def metrics_markdown() -> str:
    out = ["| service | metric | type | labels | meaning |", "|---|---|---|---|---|"]
    for r in metric_rows():
        out.append(f"| {r['service']} | `{r['name']}` | {r['type']} | {r['labels']} | {r['help']} |")
    return "\n".join(out)


SECTIONS = {"config": config_markdown, "metrics": metrics_markdown}


def update(text: str) -> str:
    """``text`` with every generated section replaced by its current content."""
    for name, render in SECTIONS.items():
        start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
        if start not in text or end not in text:
            raise ValueError(f"markers {start} … {end} not found")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{render()}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.config_reference", description=__doc__)
    p.add_argument("--write", metavar="FILE", help="update the generated sections of FILE in place")
    args = p.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(update(path.read_text()))
        print(f"updated {path}")
    else:
        print(config_markdown() + "\n\n" + metrics_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
