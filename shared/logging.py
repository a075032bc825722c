"""structlog setup: JSON lines by default, readable on a terminal, and never any content.

The redaction processor removes prompt text, token ids and cache contents from every event
before it is rendered, whatever a caller passed: keys that name such content are replaced
by ``"<redacted>"`` and any string longer than ``MAX_FIELD_CHARS`` is cut to its length.
With tracing on, a line logged inside a recorded span carries its ``trace_id`` and ``span_id``.

:class:`JsonLinesFile` is where a supervisor (``kvledger up``) writes a child's output: one JSON
object per line whatever the child printed (a plain line becomes an ``output`` record), rotated
by size (``logging.max_bytes``, ``logging.backups``).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace

#: Keys whose values are content, never to be logged.
REDACTED_KEYS = frozenset({
    "prompt", "prompts", "text", "content", "messages", "completion", "choices", "tokens",
    "token_ids", "input_ids", "output_ids", "logits", "kv", "tensor", "payload", "data",
    "body", "stop", "api_key", "authorization", "salt", "tenant_salt",
})
MAX_FIELD_CHARS = 512
#: ``scheme://user:password@host`` — the password part is masked wherever it appears.
_URL_CREDENTIALS = re.compile(r"(\b[a-z][a-z0-9+.\-]*://[^/\s:@]*:)([^@\s/]+)(@)", re.IGNORECASE)


def mask_credentials(text: str) -> str:
    """``nats://kvl:s3cret@h:4222`` → ``nats://kvl:***@h:4222``."""
    return _URL_CREDENTIALS.sub(r"\1***\3", text)


def redact_content(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event.keys()):
        if key in ("event", "level", "timestamp", "logger", "exception"):
            continue
        value = event[key]
        if key.lower() in REDACTED_KEYS:
            event[key] = "<redacted>"
        elif isinstance(value, (list, tuple)) and len(value) > 16:
            event[key] = f"<{type(value).__name__} of {len(value)} items>"
        elif isinstance(value, (bytes, bytearray, memoryview)):
            event[key] = f"<{len(value)} bytes>"
        elif isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
            event[key] = f"<{len(value)} chars>"
        elif isinstance(value, str) and "://" in value:
            event[key] = mask_credentials(value)
        elif type(value).__name__ == "Tensor":
            event[key] = "<tensor>"
    msg = event.get("event")
    if isinstance(msg, str) and "://" in msg:
        event["event"] = mask_credentials(msg)
    return event


def log_trace_ids(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: ``trace_id`` and ``span_id`` of the span a line is logged in (a
    recorded one), so a log line leads to its trace and back. With tracing off no span is ever
    current (``shared.tracing`` makes none), so nothing is added."""
    # NOTE: here and not in shared.tracing, which logs through this module: no import cycle.
    ctx = trace.get_current_span().get_span_context()
    if ctx.trace_flags.sampled:
        event["trace_id"] = format(ctx.trace_id, "032x")
        event["span_id"] = format(ctx.span_id, "016x")
    return event


def configure_logging(fmt: str = "auto", level: str = "info", stream: Any = None) -> None:
    """Configure structlog for the process. ``fmt``: json | console | auto (console on a TTY)."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer: Any = (structlog.dev.ConsoleRenderer(colors=False) if fmt == "console"
                     else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            log_trace_ids,      # trace_id / span_id while a traced request's span is current
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact_content,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


#: Longest plain output line kept whole in an ``output`` record (a longer one is cut, marked).
MAX_OUTPUT_CHARS = 4096


def as_json_line(line: str, logger: str, level: str = "info") -> str:
    """``line`` (without its newline) as one JSON object: unchanged when it is one already, else an
    ``output`` record holding the text (credentials in URLs masked, cut at ``MAX_OUTPUT_CHARS``)."""
    line = line.rstrip("\r\n")
    if line.startswith("{"):
        try:
            if isinstance(json.loads(line), dict):
                return line
        except ValueError:
            pass
    text = mask_credentials(line)
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + f"…<{len(text) - MAX_OUTPUT_CHARS} more chars>"
    ts = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
    return json.dumps({"event": "output", "level": level, "logger": logger, "timestamp": ts, "line": text},
                      ensure_ascii=False)


class JsonLinesFile:
    """A JSON-lines log file rotated by size: ``path`` → ``path.1`` … ``path.<backups>`` (the oldest
    deleted), before a line would take it to ``max_bytes`` (stdlib ``RotatingFileHandler``).
    Thread-safe: the handler's lock serialises writers and rotation."""

    def __init__(self, path: Path, max_bytes: int, backups: int, logger: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.logger = logger
        self._handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                             encoding="utf-8", delay=True)
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def write(self, line: str, level: str = "info") -> None:
        """One line of output (JSON or not) as one JSON line; flushed."""
        self.write_json(as_json_line(line, self.logger, level))

    def write_json(self, text: str) -> None:
        self._handler.handle(logging.makeLogRecord({"msg": text, "args": (), "levelno": logging.INFO}))

    def close(self) -> None:
        self._handler.close()
