"""``shared.tracing``: W3C trace context through HTTP and NATS headers, nothing at all when off,
the config keys, and trace ids in log lines. The connected trace across the three services is
``tests/integration/test_request_trace.py``."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import tracing
from shared.config import ConfigError, TracingConfig, load_config, parse_config
from shared.logging import configure_logging, get_logger

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")   # flags: sampled, random ids


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Tracing on, spans kept in memory; off again afterwards."""
    out = InMemorySpanExporter()
    assert tracing.setup(TracingConfig(), "test", exporter=out)
    try:
        yield out
    finally:
        tracing.shutdown()


def test_a_traceparent_round_trips_through_http_and_nats_headers(exporter: InMemorySpanExporter) -> None:
    with tracing.span("caller", kind=tracing.CLIENT) as caller:
        nats_headers = tracing.headers()                       # a NATS message's header dict
        http_headers = tracing.headers({"Content-Type": "application/json"})
    ids = caller.get_span_context()
    for carried in (nats_headers, http_headers):
        m = TRACEPARENT.match(carried["traceparent"])
        assert m and (int(m[1], 16), int(m[2], 16)) == (ids.trace_id, ids.span_id)
    assert http_headers["Content-Type"] == "application/json"
    # aiohttp hands a handler case-insensitive headers, however the sender spelled the name
    received = CIMultiDictProxy(CIMultiDict({"Traceparent": http_headers["traceparent"]}))
    for carrier in (received, dict(nats_headers)):
        with tracing.span("callee", kind=tracing.SERVER, parent=tracing.extract(carrier)):
            pass
    callees = [s for s in exporter.get_finished_spans() if s.name == "callee"]
    assert len(callees) == 2
    for s in callees:
        assert (s.context.trace_id, s.parent.span_id, s.parent.is_remote) == (ids.trace_id, ids.span_id, True)


@pytest.mark.parametrize("carrier", [None, {}, {"traceparent": "00-zz-not-a-traceparent-01"},
                                     {"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"}])
def test_no_or_a_malformed_traceparent_starts_no_parent(exporter: InMemorySpanExporter, carrier) -> None:
    assert tracing.extract(carrier) is None
    with tracing.remote_span("coordinator.acquire", carrier) as s:
        assert s is tracing.NO_SPAN                            # a service starts no trace of its own
    with tracing.span("worker.request", kind=tracing.SERVER, parent=tracing.extract(carrier)):
        pass
    (root,) = exporter.get_finished_spans()
    assert root.parent is None                                 # an edge starts a new trace instead


def test_no_current_span_adds_no_header(exporter: InMemorySpanExporter) -> None:
    assert tracing.headers() is None                           # a heartbeat: no header block at all
    assert tracing.headers({"a": "b"}) == {"a": "b"}


def test_a_failure_is_marked_by_its_type_only_and_a_cancellation_is_no_failure(
        exporter: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError):
        with tracing.span("failing"):
            raise ValueError("a message that might quote the prompt")
    with pytest.raises(KeyboardInterrupt):
        with tracing.span("cancelled"):
            raise KeyboardInterrupt
    failing, cancelled = exporter.get_finished_spans()
    assert failing.status.description == "ValueError" and not failing.events   # no message, no stack
    assert cancelled.status.is_unset and cancelled.attributes["kvl.cancelled"] is True


def test_tracing_off_makes_no_span_and_sends_no_header() -> None:
    exporter = InMemorySpanExporter()
    tracing.setup(TracingConfig(), "test", exporter=exporter)
    tracing.shutdown()                                         # what a process with tracing off looks like
    assert not tracing.setup(TracingConfig(enabled=False), "test")
    assert not tracing.enabled()
    with tracing.span("worker.lease", {"kvl.blocks": 3}) as s:
        assert s is tracing.NO_SPAN and not s.is_recording()
        assert tracing.headers() is None and tracing.current() is tracing.NO_SPAN
    assert tracing.span("a") is tracing.span("b")              # one shared no-op object, nothing allocated
    assert tracing.start("coordinator.decide") is None
    assert tracing.extract({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}) is None
    assert exporter.get_finished_spans() == ()


def test_with_tracing_off_the_services_never_load_the_sdk() -> None:
    code = ("import sys, gateway.app, worker.api.app, worker.cache.manager, coordinator.nats_service, coordinator.app;"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_log_lines_in_a_traced_span_carry_its_ids(exporter: InMemorySpanExporter) -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    log = get_logger("kvl.test")
    with tracing.span("worker.request") as s:
        log.info("inside")
    log.info("outside")
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    ctx = s.get_span_context()
    assert (inside["trace_id"], inside["span_id"]) == (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))
    assert "trace_id" not in outside


def test_the_tracing_section_defaults_off_and_names_the_key_when_wrong() -> None:
    t = parse_config({}).tracing
    assert (t.enabled, t.otlp_endpoint, t.sample_ratio) == (False, "http://127.0.0.1:4318/v1/traces", 1.0)
    t = load_config(env={"KVL_TRACING__ENABLED": "true", "KVL_TRACING__OTLP_ENDPOINT": "http://tempo:4318/v1/traces",
                         "KVL_TRACING__SAMPLE_RATIO": "0.25"}).tracing
    assert (t.enabled, t.otlp_endpoint, t.sample_ratio) == (True, "http://tempo:4318/v1/traces", 0.25)
    for doc, message in [
        ({"enabled": True, "otlp_endpoint": "tempo:4317"}, "config key tracing.otlp_endpoint: 'tempo:4317' is not"),
        ({"sample_ratio": 1.5}, "config key tracing.sample_ratio: Expected `float` <= 1.0"),
        ({"service_name": "kv ledger"}, "config key tracing.service_name"),
        ({"export_timeout_ms": 0}, "config key tracing.export_timeout_ms"),
        ({"endpoint": "x"}, "config key tracing.endpoint: unknown key; allowed here: enabled,"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config({"tracing": doc})


def test_the_http_apps_trace_only_when_tracing_is_on() -> None:
    from gateway.app import Gateway, create_app
    from shared.config import Config

    gw = Gateway(Config(), None, None)  # type: ignore[arg-type]   # no model side needed to build the app
    assert len(create_app(gw).middlewares) == 1   # the access log's (shared.access_log) alone
    tracing.setup(TracingConfig(), "test", exporter=InMemorySpanExporter())
    try:
        assert len(create_app(gw).middlewares) == 2
    finally:
        tracing.shutdown()
