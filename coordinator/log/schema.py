"""The event log's tables, as SQLAlchemy Core, on one MetaData with a naming convention.

The naming convention gives every constraint and index a stable, predictable name, so the
Alembic migrations (``migrations/versions``) can refer to them and a test can check that
the migrated database matches these declarations exactly.

Choices worth stating:

* ``events.position`` is assigned by the (single, fenced) writer as ``head + 1, …`` inside
  the append transaction, under the leader row lock — not by a sequence. Sequence values
  are handed out at insert time but become visible at commit time, so a tailing reader
  could skip a row that commits late; serialised explicit positions are dense and in
  commit order by construction.
* ``payload`` is ``text``: the JSON the coordinator encoded (msgspec), stored and read back
  as is (migration 0004; it was JSONB, which parsed every payload on insert and
  re-serialised it on every read). Operators query it as JSON through the view
  ``events_json`` (``payload->>'block_hash'``). Events are decoded by field name, and hashes
  are computed over decoded state, never over stored bytes, so the JSONB rendering of rows
  written before 0004 decodes to the same events.
* ``source_id`` is UNIQUE and NULL for events no worker transition caused (PostgreSQL's
  UNIQUE allows any number of NULLs).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger, CheckConstraint, Column, DateTime, LargeBinary, MetaData, SmallInteger, Table, Text,
    UniqueConstraint, func,
)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

events = Table(
    "events", metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("stream_id", Text, nullable=False),
    Column("stream_version", BigInteger, nullable=False),
    Column("source_id", Text, nullable=True),
    Column("type", Text, nullable=False),
    Column("payload", Text, nullable=False),
    Column("leader_epoch", BigInteger, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: sha256 over the event and the previous event's chain_hash (migration 0006, coordinator.log.chain)
    Column("chain_hash", LargeBinary, nullable=True),
    UniqueConstraint("stream_id", "stream_version"),
    UniqueConstraint("source_id"),
    CheckConstraint("position > 0", name="position_positive"),
    CheckConstraint("stream_version > 0", name="stream_version_positive"),
)

snapshots = Table(
    "snapshots", metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("state_hash", Text, nullable=False),
    Column("state", LargeBinary, nullable=False),
    Column("leader_epoch", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: the log's chain head at ``position`` (migration 0006)
    Column("chain_hash", LargeBinary, nullable=True),
)

#: One row per archive of the log's oldest events (migration 0005, ``coordinator.log.archive``):
#: positions ``first_position..last_position`` live in the file ``file_name`` (its SHA-256),
#: and the snapshot at ``last_position`` (the anchor, state hash ``anchor_hash``) summarises them.
log_archives = Table(
    "log_archives", metadata,
    Column("last_position", BigInteger, primary_key=True, autoincrement=False),
    Column("first_position", BigInteger, nullable=False),
    Column("events", BigInteger, nullable=False),
    Column("anchor_hash", Text, nullable=False),
    Column("sha256", Text, nullable=False),
    Column("file_name", Text, nullable=False),
    Column("archived_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: the log's chain head at ``last_position`` (migration 0006; genesis for older archives)
    Column("chain_hash", LargeBinary, nullable=True),
    CheckConstraint("first_position > 0 AND last_position >= first_position", name="positions"),
)

#: A stream's version when all of its stored events were archived: ``kvl_append`` continues
#: from it, so versions never start over (migration 0005).
log_stream_floors = Table(
    "log_stream_floors", metadata,
    Column("stream_id", Text, primary_key=True),
    Column("stream_version", BigInteger, nullable=False),
    CheckConstraint("stream_version > 0", name="version_positive"),
)

#: One row: who may write (``leader_epoch`` is the fencing token every append checks).
#: Every append locks this row ``FOR UPDATE``, so nothing that must not wait behind an
#: append (the leader's renewal) writes it. ``renewed_at`` is set when an epoch is taken and
#: is no longer renewed (see ``leader_renewal``); coordinators older than migration 0002
#: still renew it, and the staleness check reads the later of the two.
leader = Table(
    "leader", metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("leader_epoch", BigInteger, nullable=False),
    Column("holder", Text, nullable=False),
    Column("since", DateTime(timezone=True), nullable=True),
    Column("renewed_at", DateTime(timezone=True), nullable=True),
    CheckConstraint("id = 1", name="singleton"),
)

#: One row: the leader's liveness (migration 0002). Appends never lock it, so a renewal
#: never waits for an append. Taking leadership writes it in the same statement as the
#: epoch bump (``leader_epoch`` here always follows ``leader.leader_epoch``); a renewal
#: updates it only ``WHERE leader_epoch = <own epoch>``, so a superseded leader's renewal
#: matches no row and it steps down.
leader_renewal = Table(
    "leader_renewal", metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("leader_epoch", BigInteger, nullable=False),
    Column("holder", Text, nullable=False),
    Column("renewed_at", DateTime(timezone=True), nullable=True),
    CheckConstraint("id = 1", name="singleton"),
)

#: The function and triggers that make ``events`` and ``snapshots`` append-only (migrations 0001, 0003).
APPEND_ONLY_FUNCTION = "kvl_refuse_log_change"
APPEND_ONLY_TRIGGERS = ("events_refuse_update_delete", "events_refuse_truncate", "snapshots_refuse_update",
                        "snapshots_refuse_delete", "snapshots_refuse_truncate", "log_archives_refuse_update_delete",
                        "log_archives_refuse_truncate")
#: The NOLOGIN group role holding exactly the coordinator's privileges (migration 0003).
WRITER_ROLE = "kvledger_writer"
