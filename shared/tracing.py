"""Request tracing: one OpenTelemetry trace per request, gateway → worker → coordinator.

Off by default (config section ``tracing``). Off means *nothing runs*: no tracer, no SDK import,
no span objects — :func:`span` hands back one shared no-op context manager, :func:`headers`
returns its argument, :func:`extract` returns None, and the services add no middleware. On,
each process has an SDK ``TracerProvider`` (parent-based ratio sampler) whose finished spans a
background thread batches to an OTLP/HTTP endpoint; a slow or absent collector costs dropped
spans, never a request's time.

Propagation is W3C Trace Context (``traceparent``, ``tracestate``) through OpenTelemetry's own
propagator, on HTTP request headers (client → gateway → worker) and on NATS message headers
(worker and gateway → coordinator). A malformed ``traceparent`` is ignored (a new trace starts),
as the W3C recommendation says.

Never content: span attributes are ids, counts and outcomes. An exception marks its span failed
with the exception's *type* only — a message may quote the request — and a cancellation (the
client went away) is an attribute, not an error. Span names and their structure are listed in
docs/operations.md ("Tracing").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.logging import get_logger, mask_credentials

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter

    from shared.config import TracingConfig

SERVER, CLIENT, INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
#: The no-op span (every method does nothing): what :func:`span` yields with tracing off.
NO_SPAN: Span = trace.INVALID_SPAN

_PROPAGATOR = TraceContextTextMapPropagator()
#: This process's tracer; None = tracing off (the one check on every path).
_tracer: trace.Tracer | None = None
_provider: Any = None   # the SDK TracerProvider, flushed by shutdown()


def enabled() -> bool:
    return _tracer is not None


def setup(cfg: TracingConfig, role: str, *, instance: str = "", exporter: SpanExporter | None = None) -> bool:
    """Install this process's tracer when ``cfg.enabled`` (or ``exporter`` is given: tests pass an
    in-memory one, which then receives each span as it ends). ``role``: gateway, worker or
    coordinator (the service name's suffix); ``instance``: the worker or gateway id. Returns
    whether tracing is on. Call before building the HTTP apps (they add a middleware when on)."""
    global _tracer, _provider
    if not cfg.enabled and exporter is None:
        return False
    shutdown()
    # NOTE: the SDK and the exporter are imported only here: a process with tracing off never loads them.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from shared.versions import package_version

    attrs = {"service.name": f"{cfg.service_name}-{role}", "service.namespace": cfg.service_name,
             "service.version": package_version()}
    if instance:
        attrs["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attrs), sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        otlp = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, timeout=cfg.export_timeout_ms / 1000)
        provider.add_span_processor(BatchSpanProcessor(
            otlp, max_queue_size=cfg.max_queue_size, schedule_delay_millis=cfg.schedule_delay_ms,
            max_export_batch_size=min(512, cfg.max_queue_size), export_timeout_millis=cfg.export_timeout_ms))
        get_logger("kvl.tracing").info("tracing_on", service=attrs["service.name"], sample_ratio=cfg.sample_ratio,
                                       otlp_endpoint=mask_credentials(cfg.otlp_endpoint))
    _provider, _tracer = provider, provider.get_tracer("kvledger", package_version())
    return True


def shutdown() -> None:
    """Flush what is queued (within the export timeout) and turn tracing off."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# --- spans ---------------------------------------------------------------------------------------

class _Off:
    """What :func:`span` returns with tracing off: one shared object, entering yields :data:`NO_SPAN`."""
    __slots__ = ()

    def __enter__(self) -> Span:
        return NO_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


class _On:
    """A started span made current for the ``with`` block, ended (and marked) on leaving it."""
    __slots__ = ("span", "_token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._token: object = None

    def __enter__(self) -> Span:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        if exc is not None:
            failed(self.span, exc)
        otel_context.detach(self._token)  # type: ignore[arg-type]
        self.span.end()


def span(name: str, attributes: Mapping[str, Any] | None = None, *, kind: SpanKind = INTERNAL,
         parent: Context | None = None) -> _On | _Off:
    """``with span("worker.lease", {...}) as s:`` — a child of the current span (or of ``parent``,
    a remote context from :func:`extract`); ``s.set_attribute`` adds to it. Off: a no-op."""
    t = _tracer
    if t is None:
        return _OFF
    return _On(t.start_span(name, context=parent, kind=kind, attributes=attributes, record_exception=False,
                            set_status_on_exception=False))


def remote_span(name: str, carrier: Mapping[str, str] | None,
                attributes: Mapping[str, Any] | None = None) -> _On | _Off:
    """Like :func:`span`, a SERVER span continuing the trace ``carrier`` (a message's headers)
    names — and a no-op when it names none: a service answering messages (the coordinator) never
    starts traces of its own, so an untraced request costs nothing but the header lookup."""
    parent = extract(carrier)
    return _OFF if parent is None else span(name, attributes, kind=SERVER, parent=parent)


def start(name: str, *, parent: Context | Span | None = None, kind: SpanKind = INTERNAL,
          attributes: Mapping[str, Any] | None = None, start_ns: int | None = None) -> Span | None:
    """A span that is not made current and that the caller ends (``span.end(end_time=...)``), for
    work that is not one block of code — a coordinator batch deciding many requests at once.
    ``parent``: a remote context (:func:`extract`) or a span. None with tracing off."""
    t = _tracer
    if t is None:
        return None
    if isinstance(parent, Span):
        parent = trace.set_span_in_context(parent)
    return t.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_ns,
                        record_exception=False, set_status_on_exception=False)


def current() -> Span:
    """The current span (:data:`NO_SPAN` when there is none or tracing is off)."""
    return NO_SPAN if _tracer is None else trace.get_current_span()


def failed(s: Span, exc: BaseException) -> None:
    """Mark ``s`` failed by ``exc``'s type alone (its message may quote the request); a
    cancellation is the caller leaving, not a failure: an attribute."""
    if isinstance(exc, Exception):
        s.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    else:
        s.set_attribute("kvl.cancelled", True)


# --- propagation ---------------------------------------------------------------------------------

def headers(carrier: MutableMapping[str, str] | None = None) -> MutableMapping[str, str] | None:
    """``carrier`` (a new dict when None) with the current span's ``traceparent`` added — for an
    outgoing HTTP request or NATS message. Unchanged (None stays None: no header block at all on
    a NATS message) when tracing is off or no span is current."""
    if _tracer is None or not trace.get_current_span().get_span_context().is_valid:
        return carrier
    out: MutableMapping[str, str] = {} if carrier is None else carrier
    _PROPAGATOR.inject(out)
    return out


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The remote parent named by ``carrier``'s ``traceparent`` (aiohttp's case-insensitive
    request headers, or a NATS message's header dict), or None: tracing off, no header, or a
    malformed one."""
    if _tracer is None or not carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


# --- HTTP and logs -------------------------------------------------------------------------------

def http_middleware(name: str, paths: frozenset[str],
                    attributes: Callable[[Any], Mapping[str, Any]] | None = None) -> Any:
    """An aiohttp middleware opening a SERVER span ``name`` for requests to ``paths`` (a child of
    the caller's ``traceparent``, else a new trace): method, path and status as attributes, plus
    ``attributes(request)`` once the handler has run. Added only when tracing is on."""
    from aiohttp import web

    @web.middleware
    async def traced(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in paths:
            return await handler(request)
        with span(name, {"http.request.method": request.method, "url.path": request.path}, kind=SERVER,
                  parent=extract(request.headers)) as s:
            try:
                resp = await handler(request)
            except web.HTTPException as e:
                s.set_attribute("http.response.status_code", e.status)
                raise
            finally:
                if attributes is not None:
                    s.set_attributes(attributes(request))
            s.set_attribute("http.response.status_code", resp.status)
            if resp.status >= 500:
                s.set_status(Status(StatusCode.ERROR, f"HTTP {resp.status}"))
            return resp

    return traced


__all__ = ["CLIENT", "INTERNAL", "NO_SPAN", "SERVER", "Status", "StatusCode", "current", "enabled", "extract", "failed",
           "headers", "http_middleware", "remote_span", "setup", "shutdown", "span", "start"]
