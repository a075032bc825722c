"""log_chain: every event carries a hash over its content and the previous event's (issue 51).

* ``events.chain_hash`` (bytea, 32 bytes): ``sha256(previous chain_hash ‖ position ‖ leader_epoch ‖
  stream_id ‖ type ‖ source_id ‖ payload)``, lengths and integers big-endian
  (:mod:`coordinator.log.chain`; ``kvl_chain_link`` below builds the same bytes). The rows
  already stored are chained here, in position order, from the newest archive's head (the
  genesis hash, 32 zero bytes: archives made before this revision carry no chain).
* ``snapshots.chain_hash`` and ``log_archives.chain_hash``: the chain head at their position,
  so that a check that starts from one has its anchor.
* ``kvl_append`` takes the chain: the caller (the coordinator, which computed the hashes of
  its batch) names the head it chained from (``p_prev_position``, ``p_prev_hash``) and gives
  one hash per event (NULL for an event it expects to be left out as a duplicate source).
  Under the leader lock the function checks that the head is that one (``KV004``, DETAIL
  ``<position>|<hex hash>`` of the real head) and that the hashes line up with the events it
  keeps (``KV005``, DETAIL the ordinals it leaves out, comma-separated); either rolls the
  append back and the caller re-chains. It computes no hash itself: an append stays one
  statement with no per-row work, and the audit, not the writer, is what checks the chain.
  The old signature is dropped (a coordinator that does not chain must not append).
* ``kvl_archive`` records the chain head at the anchor.

Rows inserted around the writer (as the owner, with ``session_replication_role = replica``)
are exactly what the chain exposes: the audit reports the first position where it breaks.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""
import importlib
from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WRITER_ROLE = "kvledger_writer"
OLD_APPEND_SIGNATURE = "kvl_append(bigint, text[], text[], text[], text[], bigint[])"
APPEND_SIGNATURE = "kvl_append(bigint, text[], text[], text[], text[], bigint[], bigint, bytea, bytea[])"
ARCHIVE_SIGNATURE = "kvl_archive(bigint, bigint, text, text, text, text[])"
LINK_SIGNATURE = "kvl_chain_link(bytea, bigint, bigint, text, text, text, text)"

#: One link of the chain in SQL (the bytes of ``coordinator.log.chain.link``), for the backfill
#: below and for an operator who wants to check a row by hand.
LINK_FUNCTION = """
CREATE FUNCTION kvl_chain_link(p_prev bytea, p_position bigint, p_epoch bigint, p_stream text, p_type text,
                               p_source text, p_payload text) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT sha256(p_prev || int8send(p_position) || int8send(p_epoch)
                  || int4send(octet_length(convert_to(p_stream, 'UTF8'))) || convert_to(p_stream, 'UTF8')
                  || int4send(octet_length(convert_to(p_type, 'UTF8'))) || convert_to(p_type, 'UTF8')
                  || CASE WHEN p_source IS NULL THEN int4send(-1)
                          ELSE int4send(octet_length(convert_to(p_source, 'UTF8'))) || convert_to(p_source, 'UTF8') END
                  || convert_to(p_payload, 'UTF8'))
$$
"""

GENESIS = "'\\x" + "00" * 32 + "'::bytea"

#: Chain the rows stored before this revision (the append-only triggers are off for it, in
#: this migration's transaction only). One pass in position order.
BACKFILL = f"""
DO $$
DECLARE
    h bytea := {GENESIS};
    r record;
BEGIN
    UPDATE log_archives SET chain_hash = {GENESIS} WHERE chain_hash IS NULL;
    FOR r IN SELECT position, leader_epoch, stream_id, type, source_id, payload FROM events ORDER BY position LOOP
        h := kvl_chain_link(h, r.position, r.leader_epoch, r.stream_id, r.type, r.source_id, r.payload);
        UPDATE events SET chain_hash = h WHERE position = r.position;
    END LOOP;
    UPDATE snapshots s SET chain_hash = coalesce(
        (SELECT e.chain_hash FROM events e WHERE e.position = s.position),
        (SELECT a.chain_hash FROM log_archives a WHERE a.last_position = s.position),
        CASE WHEN s.position = 0 THEN {GENESIS} END);
END $$"""

# The function of 0005 with the chain: the head's hash read with the head, checked against the
# caller's, and each kept event stored with its hash.
APPEND_FUNCTION = """
CREATE FUNCTION kvl_append(p_epoch bigint, p_stream text[], p_type text[], p_source text[],
                           p_payload text[], p_expected bigint[], p_prev_position bigint, p_prev_hash bytea,
                           p_hash bytea[]) RETURNS bigint[]
LANGUAGE plpgsql SECURITY INVOKER AS $$
DECLARE
    cur bigint;
    head bigint;
    head_hash bytea;
    version bigint;
    positions bigint[];
    conflict text;
    misaligned boolean;
    dropped text;
BEGIN
    SELECT leader_epoch INTO cur FROM leader WHERE id = 1 FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'kvledger: the leader row is missing: run `kvledger db upgrade`' USING ERRCODE = 'KV001';
    END IF;
    IF cur <> p_epoch THEN
        RAISE EXCEPTION 'kvledger: leader epoch % is stale: epoch % has taken over', p_epoch, cur
            USING ERRCODE = 'KV002', DETAIL = cur::text;
    END IF;
    SELECT e.position, e.chain_hash INTO head, head_hash FROM events e ORDER BY e.position DESC LIMIT 1;
    IF NOT FOUND THEN
        SELECT a.last_position, a.chain_hash INTO head, head_hash FROM log_archives a
        ORDER BY a.last_position DESC LIMIT 1;
        IF NOT FOUND THEN
            head := 0;
            head_hash := '\\x0000000000000000000000000000000000000000000000000000000000000000'::bytea;
        END IF;
    END IF;
    IF head <> p_prev_position OR head_hash IS DISTINCT FROM p_prev_hash THEN
        RAISE EXCEPTION 'kvledger: the batch is chained from position %, the head is at %', p_prev_position, head
            USING ERRCODE = 'KV004', DETAIL = format('%s|%s', head, coalesce(encode(head_hash, 'hex'), ''));
    END IF;
    IF cardinality(p_stream) = 1 THEN
        -- a lone event (a request's decision on a quiet coordinator): plain statements, no set logic
        IF p_source[1] IS NOT NULL AND EXISTS (SELECT 1 FROM events WHERE source_id = p_source[1]) THEN
            RETURN ARRAY[NULL]::bigint[];
        END IF;
        IF p_hash[1] IS NULL THEN
            RAISE EXCEPTION 'kvledger: the event has no chain hash' USING ERRCODE = 'KV005', DETAIL = '';
        END IF;
        version := coalesce((SELECT max(stream_version) FROM events WHERE stream_id = p_stream[1]),
                            (SELECT stream_version FROM log_stream_floors WHERE stream_id = p_stream[1]), 0);
        IF p_expected IS NOT NULL AND p_expected[1] IS NOT NULL AND p_expected[1] <> version THEN
            RAISE EXCEPTION 'kvledger: an expected stream version did not match' USING ERRCODE = 'KV003',
                DETAIL = format('1|%s|%s', p_expected[1], version);
        END IF;
        INSERT INTO events (position, stream_id, stream_version, source_id, type, payload, leader_epoch, chain_hash)
        VALUES (head + 1, p_stream[1], version + 1, p_source[1], p_type[1], p_payload[1], p_epoch, p_hash[1]);
        RETURN ARRAY[head + 1];
    END IF;
    WITH input AS (
        SELECT * FROM unnest(p_stream, p_type, p_source, p_payload, p_expected, p_hash)
            WITH ORDINALITY AS u(stream_id, type, source_id, payload, expected, hash, ord)
    ), fresh AS (
        SELECT i.*, i.source_id IS NULL OR (
                   row_number() OVER (PARTITION BY i.source_id ORDER BY i.ord) = 1
                   AND (SELECT 1 FROM events e WHERE e.source_id = i.source_id) IS NULL) AS keep
        FROM input i
    ), kept AS (
        SELECT f.ord, f.stream_id, f.type, f.source_id, f.payload, f.expected, f.hash,
               head + row_number() OVER (ORDER BY f.ord) AS position,
               row_number() OVER (PARTITION BY f.stream_id ORDER BY f.ord)
                   + coalesce((SELECT max(e.stream_version) FROM events e WHERE e.stream_id = f.stream_id),
                              (SELECT fl.stream_version FROM log_stream_floors fl WHERE fl.stream_id = f.stream_id),
                              0)
                   AS stream_version
        FROM fresh f WHERE f.keep
    ), stored AS (
        INSERT INTO events (position, stream_id, stream_version, source_id, type, payload, leader_epoch, chain_hash)
        SELECT k.position, k.stream_id, k.stream_version, k.source_id, k.type, k.payload, p_epoch, k.hash FROM kept k
        RETURNING 1
    )
    SELECT array_agg(k.position ORDER BY i.ord),
           min(CASE WHEN k.expected IS NOT NULL AND k.expected <> k.stream_version - 1
                    THEN format('%s|%s|%s', lpad(i.ord::text, 10, '0'), k.expected, k.stream_version - 1) END),
           bool_or((k.ord IS NULL) <> (i.hash IS NULL)),
           string_agg(CASE WHEN k.ord IS NULL THEN i.ord::text END, ',' ORDER BY i.ord)
    INTO positions, conflict, misaligned, dropped
    FROM input i LEFT JOIN kept k ON k.ord = i.ord;
    IF conflict IS NOT NULL THEN
        RAISE EXCEPTION 'kvledger: an expected stream version did not match' USING ERRCODE = 'KV003',
            DETAIL = conflict;
    END IF;
    IF misaligned THEN
        RAISE EXCEPTION 'kvledger: the chain hashes do not line up with the events kept' USING ERRCODE = 'KV005',
            DETAIL = coalesce(dropped, '');
    END IF;
    RETURN positions;
END
$$
"""

ARCHIVE_FUNCTION = """
CREATE OR REPLACE FUNCTION kvl_archive(p_upto bigint, p_events bigint, p_anchor_hash text, p_sha256 text, p_file text,
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
    -- the chain head at the anchor (migration 0006): where the audit's chain check starts afterwards
    INSERT INTO log_archives (last_position, first_position, events, anchor_hash, sha256, file_name, chain_hash)
    VALUES (p_upto, prev + 1, p_events, p_anchor_hash, p_sha256, p_file,
            (SELECT chain_hash FROM events WHERE position = p_upto));
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

REFUSING_TRIGGERS = (("events", "events_refuse_update_delete"), ("snapshots", "snapshots_refuse_update"),
                     ("log_archives", "log_archives_refuse_update_delete"))


def _configure(signature: str, generic: bool) -> None:
    op.execute(f"""
        DO $$ BEGIN
            EXECUTE format('ALTER FUNCTION {signature} SET search_path = %I, pg_temp', current_schema());
        END $$""")
    if generic:
        op.execute(f"ALTER FUNCTION {signature} SET plan_cache_mode = force_generic_plan")


def upgrade() -> None:
    for table in ("events", "snapshots", "log_archives"):
        op.execute(f"ALTER TABLE {table} ADD COLUMN chain_hash bytea")
    op.execute(LINK_FUNCTION)
    for table, trigger in REFUSING_TRIGGERS:
        op.execute(f"ALTER TABLE {table} DISABLE TRIGGER {trigger}")
    op.execute(BACKFILL)
    for table, trigger in REFUSING_TRIGGERS:
        op.execute(f"ALTER TABLE {table} ENABLE TRIGGER {trigger}")
    op.execute(f"DROP FUNCTION {OLD_APPEND_SIGNATURE}")
    op.execute(APPEND_FUNCTION)
    _configure(APPEND_SIGNATURE, True)
    op.execute(f"REVOKE ALL ON FUNCTION {APPEND_SIGNATURE} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {APPEND_SIGNATURE} TO {WRITER_ROLE}")
    op.execute(ARCHIVE_FUNCTION)
    _configure(ARCHIVE_SIGNATURE, False)


def downgrade() -> None:
    previous = importlib.import_module("migrations.versions.0005_log_archive")
    op.execute(f"DROP FUNCTION {APPEND_SIGNATURE}")
    op.execute(previous.APPEND_FUNCTION.replace("CREATE OR REPLACE FUNCTION", "CREATE FUNCTION", 1))
    _configure(previous.APPEND_SIGNATURE, True)
    op.execute(f"REVOKE ALL ON FUNCTION {previous.APPEND_SIGNATURE} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {previous.APPEND_SIGNATURE} TO {WRITER_ROLE}")
    op.execute(previous.ARCHIVE_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    _configure(ARCHIVE_SIGNATURE, False)
    op.execute(f"DROP FUNCTION {LINK_SIGNATURE}")
    for table in ("events", "snapshots", "log_archives"):
        op.execute(f"ALTER TABLE {table} DROP COLUMN chain_hash")
