"""append_function: payloads stored as the coordinator's own JSON text, and one round trip per append.

Three changes that the coordinator's speed needs (docs/architecture.md, "The log"):

* ``events.payload`` becomes ``text``: exactly the JSON bytes the coordinator encoded. JSONB
  parsed every payload on insert and re-serialised it on every read (about 20 µs a row here,
  the larger part of a replay's read); text is stored and handed back as is. Existing rows are
  converted with JSONB's own text form, which decodes to the same events. The log stays
  queryable with SQL through the view ``events_json`` (``payload`` as ``jsonb``), e.g.
  ``SELECT payload->>'reason' FROM events_json WHERE type = 'transition.rejected'``.
* ``payload`` is compressed with lz4 where the server supports it (pglz, the default, was half
  the cost of appending a lease grant).
* ``kvl_append(epoch, streams, types, sources, payloads, expected)`` does a whole append in
  one statement, hence one round trip and one commit: the fence (the ``leader`` row locked
  ``FOR UPDATE`` and its epoch compared), positions ``head + 1 …`` in batch order, duplicate
  source ids left out (``NULL`` in the result), stream versions from the stored heads, and the
  optional expected-version check. It returns the position of each input event. A lone event
  (the common case on a quiet coordinator) takes plain statements instead of the set logic (a
  third less time). It runs with the caller's privileges (``SECURITY INVOKER``: the writer
  role's INSERT on ``events`` and UPDATE on ``leader``), with a fixed ``search_path`` and
  generic plans (a custom plan per call cost more than the append itself).

Errors it raises, for the adapter to translate: ``KV001`` the leader row is missing; ``KV002``
the caller's epoch is stale (``DETAIL``: the current epoch); ``KV003`` an expected version did
not match (``DETAIL``: ``<input ordinal>|<expected>|<actual head>``). Any of them rolls the
whole append back.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""
from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WRITER_ROLE = "kvledger_writer"
SIGNATURE = "kvl_append(bigint, text[], text[], text[], text[], bigint[])"

# NOTE: the per-row subqueries are scalar (correlated, one index probe each) on purpose: as
# NOT EXISTS or a join the generic plan may hash the whole events table.
APPEND_FUNCTION = """
CREATE FUNCTION kvl_append(p_epoch bigint, p_stream text[], p_type text[], p_source text[],
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
    SELECT coalesce(max(position), 0) INTO head FROM events;
    IF cardinality(p_stream) = 1 THEN
        -- a lone event (a request's decision on a quiet coordinator): plain statements, no set logic
        IF p_source[1] IS NOT NULL AND EXISTS (SELECT 1 FROM events WHERE source_id = p_source[1]) THEN
            RETURN ARRAY[NULL]::bigint[];
        END IF;
        SELECT coalesce(max(stream_version), 0) INTO version FROM events WHERE stream_id = p_stream[1];
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
                   + coalesce((SELECT max(e.stream_version) FROM events e WHERE e.stream_id = f.stream_id), 0)
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

VIEW = """
CREATE VIEW events_json AS
SELECT position, stream_id, stream_version, source_id, type, payload::jsonb AS payload, leader_epoch, recorded_at
FROM events
"""


# NOTE: a grant's payload (~2.5 kB) is over the TOAST threshold, and pglz, the default
# compression, cost ~25 us of PostgreSQL CPU per such row here (about half an append's cost);
# lz4 compresses it to the same size in a tenth of the time. Only where the server has it.
LZ4 = """
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression'
               AND 'lz4' = ANY(enumvals)) THEN
        ALTER TABLE events ALTER COLUMN payload SET COMPRESSION lz4;
    END IF;
END $$"""


def upgrade() -> None:
    op.execute("ALTER TABLE events ALTER COLUMN payload TYPE text USING payload::text")
    op.execute(LZ4)
    op.execute(VIEW)
    op.execute(APPEND_FUNCTION)
    op.execute(f"""
        DO $$ BEGIN
            EXECUTE format('ALTER FUNCTION {SIGNATURE} SET search_path = %I, pg_temp', current_schema());
        END $$""")
    op.execute(f"ALTER FUNCTION {SIGNATURE} SET plan_cache_mode = force_generic_plan")
    op.execute(f"REVOKE ALL ON FUNCTION {SIGNATURE} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {SIGNATURE} TO {WRITER_ROLE}")
    op.execute(f"GRANT SELECT ON events_json TO {WRITER_ROLE}")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {SIGNATURE}")
    op.execute("DROP VIEW events_json")
    op.execute("ALTER TABLE events ALTER COLUMN payload TYPE jsonb USING payload::jsonb")
