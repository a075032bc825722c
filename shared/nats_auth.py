"""Identities on the bus: each participant is its own NATS user, confined to its own subjects.

NATS enforces it (users with publish/subscribe permissions in the server's ``authorization``
block), so a participant cannot even emit a message outside its role — no homemade signature
scheme. The coordinator also checks that the worker id inside a request matches the subject it
arrived on (``coordinator.nats_service``), so a message is attributable to the connection
that sent it.

======================  =====================================================================
user                    may
======================  =====================================================================
``coordinator``         take every worker's requests (``<p>.req.*.*``) and every gateway's
                        route queries (``<p>.route.*``), in the queue group ``kvl-coordinator``
                        only (no other identity may join it), and answer them;
                        publish watermarks, inventory and control to workers; use JetStream's
                        API and acknowledge its transitions. Never publish a transition.
``coordinator.s<k>``    the same, as shard k ≥ 1 of a sharded ledger, under that shard's prefix
                        ``<p>.s<k>`` only (``shared.shards``); ``coordinator`` is shard 0, under
                        ``<p>`` only. The other identities get their grants under every shard's
                        prefix (``shards`` in :func:`permissions`).
``worker.<id>``         request only ``<p>.req.<id>.*``; publish only ``<p>.events.<id>``;
                        receive only ``<p>.worker.<id>.>`` and answer what it receives.
``gateway.<id>``        ask only ``<p>.route.<id>`` (which workers hold a prefix: read-only);
                        nothing else on the bus (it reaches workers over HTTP).
``operator``            ask any worker's debug subjects (``<p>.worker.*.debug.>``) and read
                        JetStream stream and consumer information.
``observer``            read-only: subscribe to the transitions (``<p>.events.>``) and the
                        commit watermarks (``<p>.worker.*.watermark``), never in a queue group
                        and never on a request subject; read JetStream information.
======================  =====================================================================

Nobody but the coordinator subscribes in a queue group (every other user's subscribe permissions
deny ``"> >"``: any subject in any queue), and the coordinator only in ``kvl-coordinator``.
Each user's replies arrive under its own inbox prefix (``_INBOX.<user>``), and it may subscribe
only there, so no participant can read another's replies. Answers to requests are allowed by
``allow_responses`` (one reply to a request actually received), not by a publish grant on inboxes.

Passwords: :class:`CredentialStore` generates one per user (``<dir>/<user>.password``, 0600, in a
0700 directory) and writes the server's configuration (0600) for the embedded nats-server;
:func:`server_config` with :class:`EnvRef` values writes the same permissions for a server that
reads its passwords from the environment (compose: ``deploy/nats/nats.conf``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.shards import map_bucket, shard_subjects
from shared.subjects import COORDINATOR_QUEUE, Subjects

ROLES = ("coordinator", "worker", "gateway", "operator", "observer")
#: Roles whose identity carries a name (one user per worker, per gateway).
NAMED = ("worker", "gateway")
_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+\Z")
#: The name of shard k ≥ 1's coordinator identity (``coordinator.s<k>``; shard 0's has none).
_SHARD_NAME = re.compile(r"^s[1-9][0-9]*\Z")


class AuthConfigError(ValueError):
    """Credentials that cannot be used; the message names the key or file."""


@dataclass(frozen=True, slots=True)
class Identity:
    role: str
    #: The worker id, for a worker; empty otherwise.
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; one of {', '.join(ROLES)}")
        if self.role == "coordinator" and self.name:
            if not _SHARD_NAME.match(self.name):
                raise ValueError("a coordinator identity is 'coordinator' (shard 0) or 'coordinator.s<k>' (shard k ≥ 1)")
            return
        if (self.role in NAMED) != bool(self.name) or (self.name and not _TOKEN.match(self.name)):
            raise ValueError("a worker or gateway identity needs an id of letters, digits, '_' or '-' "
                             "(and only they have one)")

    @property
    def shard(self) -> int:
        """The shard a coordinator identity speaks for (0 for every other identity)."""
        return int(self.name[1:]) if self.role == "coordinator" and self.name else 0

    @property
    def user(self) -> str:
        return f"{self.role}.{self.name}" if self.name else self.role

    @classmethod
    def parse(cls, user: str) -> "Identity":
        role, _, name = user.partition(".")
        try:
            return cls(role, name)
        except ValueError as e:
            raise AuthConfigError(f"NATS user {user!r} is not a kvledger identity (coordinator, coordinator.s<shard>, "
                                  f"operator, observer, worker.<worker id> or gateway.<gateway id>): {e}") from None


def coordinator(shard: int = 0) -> Identity:
    """Shard ``shard``'s coordinator identity: ``coordinator`` for shard 0, ``coordinator.s<k>`` for k ≥ 1."""
    return Identity("coordinator", f"s{shard}" if shard else "")


def inbox_prefix(user: str) -> str:
    """Where ``user``'s replies arrive; its permissions let it subscribe only below this."""
    return f"_INBOX.{user}"


def worker(worker_id: str) -> Identity:
    return Identity("worker", worker_id)


def gateway(gateway_id: str) -> Identity:
    return Identity("gateway", gateway_id)


STANDARD = (Identity("coordinator"), Identity("operator"), Identity("observer"))

_JS_INFO = ["$JS.API.INFO"]


#: A subscribe deny entry that matches every subject *in any queue group* (NATS ≥ 2.2 reads
#: "<subject> <queue>"; ``>`` as the queue matches every queue name): plain subscriptions its
#: allow list grants stay allowed, queue subscriptions are refused. NOTE: an allow entry without
#: a queue also grants queue subscriptions on its subjects — that is how an observer allowed
#: ``<p>.>`` could join ``kvl-coordinator`` and take the coordinator's requests.
NO_QUEUES = "> >"


def queue_entry(subject: str, queue: str) -> str:
    """A permission entry that grants ``subject`` in queue group ``queue`` only."""
    return f"{subject} {queue}"


def permissions(identity: Identity, subjects: Subjects, shards: int = 1) -> dict[str, Any]:
    """The NATS permissions block of ``identity`` (see the table in the module docstring), in a
    ledger of ``shards`` shards whose shard 0 is ``subjects``: a coordinator's under its own shard's
    subjects only, every other identity's under each shard's.

    Only the coordinator subscribes in a queue group (:data:`COORDINATOR_QUEUE`, on request and
    route subjects, and nowhere else); every other identity subscribes plainly, never in a queue
    group, and nobody but the coordinator subscribes to a request subject (a plain subscriber
    there would hide the coordinator's absence: requests would time out instead of failing fast
    with "no responders")."""
    if identity.role == "coordinator":
        grant = _permissions(identity, shard_subjects(subjects.prefix, identity.shard))
        if shards > 1:      # the first coordinator to start stores the config's map (shared.shard_store)
            grant["publish"]["allow"].append(f"$KV.{map_bucket(subjects.prefix)}.map")
        return grant
    merged: dict[str, Any] = {}
    for k in range(shards):
        for direction, grant in _permissions(identity, shard_subjects(subjects.prefix, k)).items():
            if not isinstance(grant, dict):
                merged[direction] = grant
                continue
            into = merged.setdefault(direction, {})
            for kind, entries in grant.items():
                into[kind] = list(dict.fromkeys([*into.get(kind, []), *entries]))
    if shards > 1 and identity.role in ("operator", "gateway", "worker"):
        # read the shard map (a gateway and a worker route by it); `kvledger shard` (the operator) also writes
        # its next version, by compare-and-set
        b = map_bucket(subjects.prefix)
        merged["publish"]["allow"] += ([f"$KV.{b}.map"] if identity.role == "operator" else []) + [
            f"$JS.API.STREAM.INFO.KV_{b}", f"$JS.API.DIRECT.GET.KV_{b}.>", f"$JS.API.STREAM.MSG.GET.KV_{b}"]
    return merged


def _permissions(identity: Identity, subjects: Subjects) -> dict[str, Any]:
    """One shard's grant (``subjects``: that shard's)."""
    p, stream, inbox = subjects.prefix, subjects.stream_name, inbox_prefix(identity.user) + ".>"
    js_info = [*_JS_INFO, f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.INFO.{stream}.*"]
    if identity.role == "coordinator":
        return {"publish": {"allow": [f"{p}.worker.*.watermark", f"{p}.worker.*.inventory", f"{p}.worker.*.control",
                                      "$JS.API.>", f"$JS.ACK.{stream}.>"]},
                "subscribe": {"allow": [queue_entry(f"{p}.req.*.*", COORDINATOR_QUEUE),
                                        queue_entry(f"{p}.route.*", COORDINATOR_QUEUE), inbox],
                              "deny": [queue_entry(inbox, ">")]},
                "allow_responses": True}
    if identity.role == "worker":
        w = identity.name
        return {"publish": {"allow": [f"{p}.req.{w}.*", f"{p}.events.{w}"]},
                "subscribe": {"allow": [f"{p}.worker.{w}.>", inbox], "deny": [NO_QUEUES]},
                "allow_responses": True}
    if identity.role == "gateway":
        return {"publish": {"allow": [f"{p}.route.{identity.name}"]},
                "subscribe": {"allow": [inbox], "deny": [NO_QUEUES]}}
    if identity.role == "operator":
        return {"publish": {"allow": [f"{p}.worker.*.debug.>", *js_info]},
                "subscribe": {"allow": [inbox], "deny": [NO_QUEUES]}}
    # observer: what it observes (transitions and commit watermarks), plainly; no request subject
    return {"publish": {"allow": js_info},
            "subscribe": {"allow": [subjects.events_wildcard, f"{p}.worker.*.watermark", inbox],
                          "deny": [NO_QUEUES]}}


@dataclass(frozen=True, slots=True)
class EnvRef:
    """A password the server reads from its environment (``$NAME`` in its configuration)."""
    name: str

    def __post_init__(self) -> None:
        if not re.match(r"^[A-Z_][A-Z0-9_]*\Z", self.name):
            raise ValueError(f"{self.name!r} is not an environment variable name")


def _value(v: Any) -> str:
    if isinstance(v, EnvRef):
        return f"${v.name}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return json.dumps(v)


def password_env(ident: Identity) -> EnvRef:
    """The environment variable a server configuration reads ``ident``'s password from
    (``NATS_PASSWORD_WORKER_WORKER_0`` for ``worker.worker-0``)."""
    return EnvRef("NATS_PASSWORD_" + re.sub(r"[^A-Z0-9]", "_", ident.user.upper()))


def server_config(passwords: Mapping[Identity, str | EnvRef], subjects: Subjects, shards: int = 1) -> str:
    """The ``authorization`` block for these users (nats-server configuration syntax)."""
    lines = ["authorization {", "  users = ["]
    for ident, password in passwords.items():
        user = {"user": ident.user, "password": password, "permissions": permissions(ident, subjects, shards)}
        lines.append(f"    {_value(user)}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


class CredentialStore:
    """Passwords of a deployment's NATS users, one 0600 file each in a 0700 directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)

    def path(self, ident: Identity) -> Path:
        return self.dir / f"{ident.user}.password"

    def password(self, ident: Identity) -> str:
        """The user's password, generated on first use and kept (restarts reuse it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        path = self.path(ident)
        try:
            if (pw := path.read_text().strip()):
                return pw
        except FileNotFoundError:
            pass
        pw = secrets.token_urlsafe(32)
        _write_private(path, pw + "\n")
        return pw

    def write_server_config(self, identities: Iterable[Identity], subjects: Subjects, shards: int = 1) -> Path:
        """``<dir>/auth.conf`` for nats-server ``-c`` (0600: it holds the passwords); with ``shards``,
        a coordinator identity for each shard too."""
        idents = list(dict.fromkeys([*STANDARD, *(coordinator(k) for k in range(1, shards)), *identities]))
        conf = self.dir / "auth.conf"
        text = ("# Generated by kvledger (shared/nats_auth.py); regenerated at each start.\n"
                + server_config({i: self.password(i) for i in idents}, subjects, shards))
        _write_private(conf, text)
        return conf

    def env(self, ident: Identity) -> dict[str, str]:
        """Config overrides that make a child process connect as ``ident``."""
        self.password(ident)
        return {"KVL_NATS__USER": ident.user, "KVL_NATS__PASSWORD_FILE": str(self.path(ident))}


def connect_kwargs(nats_cfg: Any) -> dict[str, Any]:
    """``nats.connect`` keyword arguments for the configured identity (``nats.user``, and
    ``nats.password`` or ``nats.password_file``); none when no user is configured."""
    user = nats_cfg.user
    if not user:
        return {}
    password = nats_cfg.password
    if nats_cfg.password_file:
        try:
            password = Path(nats_cfg.password_file).read_text().strip()
        except OSError as e:
            raise AuthConfigError(f"config key nats.password_file: cannot read {nats_cfg.password_file}: "
                                  f"{e.strerror}") from None
    if not password:
        raise AuthConfigError("config key nats.user is set but no password: set nats.password or nats.password_file")
    return {"user": user, "password": password, "inbox_prefix": inbox_prefix(user)}
