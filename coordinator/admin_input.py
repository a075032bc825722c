"""The admin API's input: query parameters, page cursors and the request bodies' schemas, apart from the handlers."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web

from coordinator.admin_context import CURSOR, HEX32, NAME, ApiError


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"-?[0-9]{1,20}", raw):
        raise ApiError(400, "invalid", f"query parameter {name!r} must be an integer in [{lo}, {hi}]")
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, "invalid", f"query parameter {name!r} must be an integer in [{lo}, {hi}]") from None
    if not lo <= value <= hi:
        raise ApiError(400, "invalid", f"query parameter {name!r} must be in [{lo}, {hi}], got {value}")
    return value


def _str_param(request: web.Request, name: str, pattern: re.Pattern[str] | None = None,
               allowed: list[str] | None = None) -> str | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    if allowed is not None and raw not in allowed:
        raise ApiError(400, "invalid", f"query parameter {name!r} must be one of {allowed}")
    if pattern is not None and not pattern.fullmatch(raw):
        raise ApiError(400, "invalid", f"query parameter {name!r} does not match {pattern.pattern}")
    return raw


def _sort_key(*parts: str) -> bytes:
    """A page's sort key as bytes: UTF-8 order is code point order, and NUL sorts first, so
    comparing these compares the tuples."""
    return "\x00".join(parts).encode()


def _encode_cursor(*parts: str) -> str:
    return _sort_key(*parts).hex()


def _decode_cursor(request: web.Request) -> bytes | None:
    """The position after which a page starts. Any value of the declared pattern is one (a
    cursor names a place in the order, not a row), so the schema's cursors are all accepted."""
    raw = _str_param(request, "cursor", CURSOR)
    return None if raw is None else bytes.fromhex(raw)


def _integral(value: Any) -> Any:
    """JSON Schema's ``integer`` includes ``1.0``: so does this API (msgspec alone would refuse it)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


async def _body(request: web.Request, schema: Any) -> Any:
    raw = await request.read()
    try:
        return msgspec.convert(_integral(msgspec.json.decode(raw or b"{}")), type=schema)
    except msgspec.ValidationError as e:
        raise ApiError(400, "invalid", f"request body: {e}") from None
    except msgspec.DecodeError:
        raise ApiError(400, "invalid", "request body is not valid JSON") from None


Hex32 = Annotated[str, msgspec.Meta(pattern=HEX32.pattern)]
WorkerId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=NAME.pattern)]
Reason = Annotated[str, msgspec.Meta(max_length=256)]


class InvalidateNamespace(msgspec.Struct, tag_field="scope", tag="namespace", forbid_unknown_fields=True):
    value: Hex32
    reason: Reason = ""


class InvalidateWorker(msgspec.Struct, tag_field="scope", tag="worker", forbid_unknown_fields=True):
    value: WorkerId
    reason: Reason = ""


class InvalidateBlock(msgspec.Struct, tag_field="scope", tag="block", forbid_unknown_fields=True):
    value: Hex32
    reason: Reason = ""


#: ``{"scope": "namespace"|"worker"|"block", "value": ..., "reason": ...}``: the value's form
#: depends on the scope, which the schema says with one alternative per scope.
InvalidateBody = InvalidateNamespace | InvalidateWorker | InvalidateBlock


class DrainBody(msgspec.Struct, forbid_unknown_fields=True):
    reason: Reason = ""


class CacheSwitchBody(msgspec.Struct, forbid_unknown_fields=True):
    #: "on" = reuse again, "off" = every request recomputes and nothing new is cached.
    state: Literal["on", "off"]
    #: One namespace (32 hex), or "" for every namespace.
    namespace: Annotated[str, msgspec.Meta(pattern=r"^(?:[0-9a-f]{32})?\Z")] = ""
    reason: Reason = ""


class AuditBody(msgspec.Struct, forbid_unknown_fields=True):
    #: Replay from an empty state (the strongest check) or from the latest snapshot.
    replay_from: Literal["empty", "snapshot"] = "empty"
    check_workers: bool = True
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)] = 2000
    #: Disk replicas (offload files) one live worker verifies, at most (0 = no disk check).
    disk_checks: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 64
    #: A difference with the workers must show again this much later to count (0 = no second look).
    confirm_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 500
