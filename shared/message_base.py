"""The messages' field types and checks, their enums and base struct: what every module of messages imports."""

from __future__ import annotations

import enum
import re
import time
from typing import Annotated

import msgspec

from shared.versions import SCHEMA_VERSION

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(gt=0)]
Hex32 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}\Z")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+\Z")]
#: A :data:`Name` whose characters the message's ``__post_init__`` checks (:func:`check_names`).
#: NOTE: msgspec's ``pattern`` cost ~0.65 µs a field here, half of a transition's decode (a
#: transition has three names); one set check of all of a message's names costs ~0.3 µs.
NameChars = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")


#: Exactly 32 characters; the hex check is the message's ``__post_init__`` (see :func:`_hex32s`).
Len32 = Annotated[str, msgspec.Meta(min_length=32, max_length=32)]


def _hex32s(joined: str) -> bool:
    """Whether ``joined`` (a concatenation of 32-character strings) is all lowercase hex.

    NOTE: ``bytes.fromhex`` checks every character in C (it also skips whitespace, hence the
    length check, and takes upper case, hence the ``lower()`` comparison): a tenth of a regex
    per value, which is what msgspec's ``pattern`` runs.
    """
    try:
        return len(bytes.fromhex(joined)) * 2 == len(joined) and joined == joined.lower()
    except ValueError:
        return False


def check_hex32_list(field: str, values: list[str]) -> None:
    """ValueError (a ValidationError when decoding) unless every value is 32 lowercase hex characters."""
    joined = "".join(values)
    if not (len(joined) == 32 * len(values) and _hex32s(joined)):
        bad = next((i for i, v in enumerate(values) if not _HEX32.fullmatch(v)), None)
        where = f"[{bad}]" if bad is not None else ""
        raise ValueError(f"{field}{where}: expected 32 lowercase hex characters (a block hash)")


_HEX32 = re.compile(r"[0-9a-f]{32}")


def check_names(msg: msgspec.Struct, fields: tuple[str, ...], lists: tuple[str, ...] = ()) -> None:
    """ValueError (a ValidationError when decoding) unless every name in ``fields`` (and in the
    lists ``lists``) is made of :data:`Name`'s characters; their lengths are checked by the type."""
    values = [getattr(msg, f) for f in fields]
    for f in lists:
        values.extend(getattr(msg, f))
    if _NAME_CHARS.issuperset("".join(values)):
        return
    for f in fields + lists:
        for v in ([getattr(msg, f)] if f in fields else getattr(msg, f)):
            if not _NAME_CHARS.issuperset(v):
                raise ValueError(f"{f}: {v[:40]!r} has a character outside A-Z a-z 0-9 _ . : -")


class ReplicaState(enum.StrEnum):
    ALLOCATED = "ALLOCATED"
    READY = "READY"
    EVICTED = "EVICTED"
    INVALID = "INVALID"
    LOST = "LOST"


class ErrorCode(enum.StrEnum):
    UNAVAILABLE = "unavailable"        # the log (PostgreSQL) cannot be written right now
    OVER_CAPACITY = "over_capacity"    # pool or tenant quota full and nothing evictable
    FENCED = "fenced"                  # the caller's epoch or the replica's generation is stale
    INVALID = "invalid"                # the message itself is malformed or illegal
    NOT_FOUND = "not_found"            # unknown lease, worker or block
    NOT_LEADER = "not_leader"          # this coordinator is a standby
    SUSPENDED = "suspended"            # the caller's epoch is suspended: resume with an inventory first
    FORBIDDEN = "forbidden"            # the message speaks for another identity than the one it came from
    WRONG_SHARD = "wrong_shard"        # another coordinator shard owns this chain (or it is moving): ask by the current shard map


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    v: int = SCHEMA_VERSION


def now_ms() -> int:
    return time.time_ns() // 1_000_000
