"""log_archive: retention of the event log, by archive files anchored on snapshots.

The log grew forever. An operator archives its oldest part (``kvledger log archive``,
``coordinator.log.archive``): the events up to a snapshot's position (the *anchor*) are
written to a file, folded to prove they reproduce the anchor's state hash, and only then
deleted from ``events``, all in one call of ``kvl_archive`` here. Replays and the audit start
"from the beginning" at the newest anchor from then on (docs/architecture.md, "Retention").

* ``log_archives``: one row per archive (append-only like the log): the positions it holds,
  the anchor's state hash, the file's SHA-256 and name.
* ``log_stream_floors``: the version an open stream had reached when all of its stored events
  were archived, so that its versions continue (``UNIQUE(stream, version)`` is checked only
  against the rows still stored). A replica or lease stream is open if the anchor's state holds
  it (the archive passes that list); one that had ended and comes back later starts at 1 again
  — floors for every stream ever seen would grow with history (one per block ever cached).
* ``kvl_append`` takes the head position from ``log_archives`` and a stream's version from
  its floor when ``events`` holds none (one more index probe, only then).
* ``kvl_archive(upto, events, anchor_hash, sha256, file, open_streams)``: checks that a snapshot with that
  hash sits at ``upto``, that every position after the previous archive up to ``upto`` is
  stored and that there are ``events`` of them, records the archive and the floors, deletes
  the events and the snapshots it supersedes (an older archive's anchor stays). It runs
  with the caller's privileges: the schema owner's (the coordinator's ``kvledger_writer``
  role has no DELETE and may not call it).
* The append-only guard lets a DELETE through only inside ``kvl_archive``: it sets
  ``kvledger.archiving`` to the position of the archive row it has just inserted in the same
  transaction, and the trigger checks both. A stray ``DELETE FROM events`` is still refused.

Downgrading is refused once anything has been archived: the older ``kvl_append`` would take
the head from the stored rows alone and hand out positions the archive already holds.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""
import importlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WRITER_ROLE = "kvledger_writer"
APPEND_SIGNATURE = "kvl_append(bigint, text[], text[], text[], text[], bigint[])"
ARCHIVE_SIGNATURE = "kvl_archive(bigint, bigint, text, text, text, text[])"

REFUSE_FUNCTION = """
CREATE OR REPLACE FUNCTION kvl_refuse_log_change() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    upto text := current_setting('kvledger.archiving', true);
BEGIN
    -- NOTE: kvl_archive sets kvledger.archiving to the archive it recorded in this very
    -- transaction; anything else (a stray DELETE, an UPDATE, a TRUNCATE) is refused.
    IF TG_OP = 'DELETE' AND TG_TABLE_NAME IN ('events', 'snapshots') AND coalesce(upto, '') <> ''
       AND EXISTS (SELECT 1 FROM log_archives
                   WHERE last_position = upto::bigint AND xmin = pg_current_xact_id()::xid) THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'kvledger: % on table "%" is refused: the event log is append-only',
        TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation',
              HINT = 'history is never edited; retention is by `kvledger log archive` (an archive file anchored '
                     'on a snapshot)';
END
$$
"""

OLD_REFUSE_FUNCTION = """
CREATE OR REPLACE FUNCTION kvl_refuse_log_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'kvledger: % on table "%" is refused: the event log is append-only',
        TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation',
              HINT = 'history is never edited; retention happens by snapshot and archived partitions';
END
$$
"""

# The function of 0004 with two changes: the head falls back to the last archived position,
# and a stream's version to its floor. coalesce() evaluates its second argument only when the
# first is NULL, so an append to a stream with stored rows pays nothing more.
APPEND_FUNCTION = """
CREATE OR REPLACE FUNCTION kvl_append(p_epoch bigint, p_stream text[], p_type text[], p_source text[],
                                      p_payload text[], p_expected bigint[]) RETURNS bigint[]
LANGUAGE plpgsql SECURITY INVOKER AS $$
DECLARE
    cur bigint;
    head bigint;
    version bigint;
    positions bigint[];
    conflict text;
BEGIN
    SELECT leader_epoch INTO cur FROM leader WHERE id = 1 FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'kvledger: the leader row is missing: run `kvledger db upgrade`' USING ERRCODE = 'KV001';
    END IF;
    IF cur <> p_epoch THEN
        RAISE EXCEPTION 'kvledger: leader epoch % is stale: epoch % has taken over', p_epoch, cur
            USING ERRCODE = 'KV002', DETAIL = cur::text;
    END IF;
    head := coalesce((SELECT max(position) FROM events), (SELECT max(last_position) FROM log_archives), 0);
    IF cardinality(p_stream) = 1 THEN
        -- a lone event (a request's decision on a quiet coordinator): plain statements, no set logic
        IF p_source[1] IS NOT NULL AND EXISTS (SELECT 1 FROM events WHERE source_id = p_source[1]) THEN
            RETURN ARRAY[NULL]::bigint[];
        END IF;
        version := coalesce((SELECT max(stream_version) FROM events WHERE stream_id = p_stream[1]),
                            (SELECT stream_version FROM log_stream_floors WHERE stream_id = p_stream[1]), 0);
        IF p_expected IS NOT NULL AND p_expected[1] IS NOT NULL AND p_expected[1] <> version THEN
            RAISE EXCEPTION 'kvledger: an expected stream version did not match' USING ERRCODE = 'KV003',
                DETAIL = format('1|%s|%s', p_expected[1], version);
        END IF;
        INSERT INTO events (position, stream_id, stream_version, source_id, type, payload, leader_epoch)
        VALUES (head + 1, p_stream[1], version + 1, p_source[1], p_type[1], p_payload[1], p_epoch);
        RETURN ARRAY[head + 1];
    END IF;
    WITH input AS (
        SELECT * FROM unnest(p_stream, p_type, p_source, p_payload, p_expected)
            WITH ORDINALITY AS u(stream_id, type, source_id, payload, expected, ord)
    ), fresh AS (
        SELECT i.*, i.source_id IS NULL OR (
                   row_number() OVER (PARTITION BY i.source_id ORDER BY i.ord) = 1
                   AND (SELECT 1 FROM events e WHERE e.source_id = i.source_id) IS NULL) AS keep
        FROM input i
    ), kept AS (
        SELECT f.ord, f.stream_id, f.type, f.source_id, f.payload, f.expected,
               head + row_number() OVER (ORDER BY f.ord) AS position,
               row_number() OVER (PARTITION BY f.stream_id ORDER BY f.ord)
                   + coalesce((SELECT max(e.stream_version) FROM events e WHERE e.stream_id = f.stream_id),
                              (SELECT fl.stream_version FROM log_stream_floors fl WHERE fl.stream_id = f.stream_id),
                              0)
                   AS stream_version
        FROM fresh f WHERE f.keep
    ), stored AS (
        INSERT INTO events (position, stream_id, stream_version, source_id, type, payload, leader_epoch)
        SELECT k.position, k.stream_id, k.stream_version, k.source_id, k.type, k.payload, p_epoch FROM kept k
        RETURNING 1
    )
    SELECT array_agg(k.position ORDER BY i.ord),
           min(CASE WHEN k.expected IS NOT NULL AND k.expected <> k.stream_version - 1
                    THEN format('%s|%s|%s', lpad(i.ord::text, 10, '0'), k.expected, k.stream_version - 1) END)
    INTO positions, conflict
    FROM input i LEFT JOIN kept k ON k.ord = i.ord;
    IF conflict IS NOT NULL THEN
        RAISE EXCEPTION 'kvledger: an expected stream version did not match' USING ERRCODE = 'KV003',
            DETAIL = conflict;
    END IF;
    RETURN positions;
END
$$
"""

# Errors, for the archive command to translate: KV010 nothing new to archive (upto not past
# the last archive), KV011 no snapshot with that hash at upto, KV012 the stored events are not
# exactly the ones the file holds (DETAIL: stored count and expected).
ARCHIVE_FUNCTION = """
CREATE FUNCTION kvl_archive(p_upto bigint, p_events bigint, p_anchor_hash text, p_sha256 text, p_file text,
                            p_open text[])
RETURNS bigint LANGUAGE plpgsql SECURITY INVOKER AS $$
DECLARE
    prev bigint;
    stored bigint;
BEGIN
    -- one archive at a time (a second waits, then finds its range already archived)
    LOCK TABLE log_archives IN SHARE ROW EXCLUSIVE MODE;
    prev := coalesce((SELECT max(last_position) FROM log_archives), 0);
    IF p_upto <= prev THEN
        RAISE EXCEPTION 'kvledger: the log is already archived up to position %', prev
            USING ERRCODE = 'KV010', DETAIL = prev::text;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM snapshots WHERE position = p_upto AND state_hash = p_anchor_hash) THEN
        RAISE EXCEPTION 'kvledger: no snapshot with state hash % at position %', p_anchor_hash, p_upto
            USING ERRCODE = 'KV011';
    END IF;
    SELECT count(*) INTO stored FROM events WHERE position > prev AND position <= p_upto;
    IF stored <> p_upto - prev OR stored <> p_events THEN
        RAISE EXCEPTION 'kvledger: % events are stored in positions % to %, the archive holds %',
            stored, prev + 1, p_upto, p_events USING ERRCODE = 'KV012', DETAIL = format('%s|%s', stored, p_events);
    END IF;
    INSERT INTO log_archives (last_position, first_position, events, anchor_hash, sha256, file_name)
    VALUES (p_upto, prev + 1, p_events, p_anchor_hash, p_sha256, p_file);
    -- The last archived version of every open stream that keeps no stored event. Replica and
    -- lease streams are open only if the anchor's state holds them (p_open): that bounds the
    -- floors by the live state, not by history. The rest (workers, invalidations, switches,
    -- the coordinator) are few and always kept.
    DELETE FROM log_stream_floors
    WHERE (stream_id LIKE 'replica:%' OR stream_id LIKE 'lease:%') AND NOT (stream_id = ANY(p_open));
    INSERT INTO log_stream_floors (stream_id, stream_version)
    SELECT s.stream_id, s.stream_version FROM (
        SELECT DISTINCT ON (stream_id) stream_id, stream_version FROM events
        WHERE position <= p_upto ORDER BY stream_id, stream_version DESC
    ) s
    WHERE (s.stream_id = ANY(p_open) OR NOT (s.stream_id LIKE 'replica:%' OR s.stream_id LIKE 'lease:%'))
      AND NOT EXISTS (SELECT 1 FROM events e WHERE e.stream_id = s.stream_id AND e.position > p_upto)
    ON CONFLICT (stream_id) DO UPDATE SET stream_version = greatest(log_stream_floors.stream_version,
                                                                    excluded.stream_version);
    PERFORM set_config('kvledger.archiving', p_upto::text, true);
    DELETE FROM events WHERE position <= p_upto;
    DELETE FROM snapshots WHERE position < p_upto AND position NOT IN (SELECT last_position FROM log_archives);
    PERFORM set_config('kvledger.archiving', '', true);
    RETURN p_events;
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "log_archives",
        sa.Column("last_position", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("first_position", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("anchor_hash", sa.Text(), nullable=False),
        sa.Column("sha256", sa.Text(), nullable=False),
        sa.Column("file_name", sa.Text(), nullable=False),
        sa.Column("archived_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("first_position > 0 AND last_position >= first_position",
                           name="ck_log_archives_positions"),
        sa.PrimaryKeyConstraint("last_position", name="pk_log_archives"),
    )
    op.create_table(
        "log_stream_floors",
        sa.Column("stream_id", sa.Text(), nullable=False),
        sa.Column("stream_version", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("stream_version > 0", name="ck_log_stream_floors_version_positive"),
        sa.PrimaryKeyConstraint("stream_id", name="pk_log_stream_floors"),
    )
    op.execute(REFUSE_FUNCTION)
    for trigger, when in (("log_archives_refuse_update_delete", "UPDATE OR DELETE"),
                          ("log_archives_refuse_truncate", "TRUNCATE")):
        op.execute(f"CREATE TRIGGER {trigger} BEFORE {when} ON log_archives "
                   "FOR EACH STATEMENT EXECUTE FUNCTION kvl_refuse_log_change()")
    op.execute(APPEND_FUNCTION)
    _configure_append()
    op.execute(ARCHIVE_FUNCTION)
    op.execute(f"""
        DO $$ BEGIN
            EXECUTE format('ALTER FUNCTION {ARCHIVE_SIGNATURE} SET search_path = %I, pg_temp', current_schema());
        END $$""")
    op.execute(f"REVOKE ALL ON FUNCTION {ARCHIVE_SIGNATURE} FROM PUBLIC")
    # kvl_append runs as the writer and reads both tables; nothing else of them is the writer's
    for table in ("log_archives", "log_stream_floors"):
        op.execute(f"REVOKE ALL ON {table} FROM {WRITER_ROLE}")
        op.execute(f"GRANT SELECT ON {table} TO {WRITER_ROLE}")


def _configure_append() -> None:
    # NOTE: CREATE OR REPLACE resets the function's SET options: restore 0004's.
    op.execute(f"""
        DO $$ BEGIN
            EXECUTE format('ALTER FUNCTION {APPEND_SIGNATURE} SET search_path = %I, pg_temp', current_schema());
        END $$""")
    op.execute(f"ALTER FUNCTION {APPEND_SIGNATURE} SET plan_cache_mode = force_generic_plan")


def downgrade() -> None:
    op.execute("""
        DO $$ BEGIN
            IF EXISTS (SELECT 1 FROM log_archives) THEN
                RAISE EXCEPTION 'kvledger: refusing to downgrade below 0005: part of the log is archived, and the '
                                'older append function would reuse its positions';
            END IF;
        END $$""")
    op.execute(f"DROP FUNCTION {ARCHIVE_SIGNATURE}")
    previous = importlib.import_module("migrations.versions.0004_append_function")
    op.execute(previous.APPEND_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    _configure_append()
    op.execute(OLD_REFUSE_FUNCTION)
    op.drop_table("log_stream_floors")
    op.execute("DROP TRIGGER log_archives_refuse_truncate ON log_archives")
    op.execute("DROP TRIGGER log_archives_refuse_update_delete ON log_archives")
    op.drop_table("log_archives")
