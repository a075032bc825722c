"""The PostgreSQL log's SQL (appends, reads, leadership, snapshots) and the schema revision it needs."""

from __future__ import annotations

#: The Alembic revision this build's statements need (a test keeps it equal to the head of
#: ``migrations/``). NOTE: a constant, so that a coordinator's start checks the schema with one
#: query and imports Alembic and SQLAlchemy only when it has to migrate (a third of its start).
SCHEMA_REVISION = "0006"

READ_LEADER_EPOCH = "SELECT leader_epoch FROM leader WHERE id = 1"
#: The head counts archived positions (migration 0005): a log archived up to its head has no rows.
HEAD = "SELECT coalesce((SELECT max(position) FROM events), (SELECT max(last_position) FROM log_archives), 0)"
#: A whole append, one statement (migrations 0004, 0006): the fence, positions, stream versions,
#: duplicate sources, the check that the batch's chain hashes link to the head; returns each
#: event's position (NULL for a duplicate source).
APPEND = "SELECT kvl_append($1, $2, $3, $4, $5, $6, $7, $8, $9)"
#: An append by COPY, in its transaction: first the fence (the leader row locked ``FOR UPDATE``,
#: its epoch returned for the caller to compare), then, in a statement of its own, the head and
#: each given stream's current version (its floor when ``events`` holds none), as kvl_append
#: computes them (migration 0005). NOTE: two statements, because a statement's snapshot is
#: taken when it starts: one that waited for the lock would read the head as it was before the
#: append it waited for committed (READ COMMITTED re-reads only the locked row).
COPY_APPEND_LOCK = "SELECT leader_epoch FROM leader WHERE id = 1 FOR UPDATE"
COPY_APPEND_HEADS = """
WITH h AS (SELECT coalesce((SELECT max(position) FROM events), (SELECT max(last_position) FROM log_archives), 0)
                  AS head)
SELECT h.head,
       ARRAY(SELECT coalesce((SELECT max(e.stream_version) FROM events e WHERE e.stream_id = u.s),
                             (SELECT f.stream_version FROM log_stream_floors f WHERE f.stream_id = u.s), 0)
             FROM unnest($1::text[]) WITH ORDINALITY AS u(s, o) ORDER BY u.o),
       coalesce((SELECT chain_hash FROM events WHERE position = h.head),
                (SELECT chain_hash FROM log_archives WHERE last_position = h.head))
FROM h
"""
COPY_COLUMNS = ("position", "stream_id", "stream_version", "source_id", "type", "payload", "leader_epoch",
                "chain_hash")
SQLSTATE_UNIQUE_VIOLATION = "23505"
#: kvl_append's own errors (migration 0004).
SQLSTATE_NO_LEADER_ROW, SQLSTATE_NOT_LEADER, SQLSTATE_STREAM_CONFLICT = "KV001", "KV002", "KV003"
#: kvl_append's chain errors (migration 0006): the head is not the one the batch was chained from
#: (DETAIL ``<position>|<hex>``); the hashes do not line up with the kept events (DETAIL: the
#: ordinals left out). Either is answered by re-chaining the batch, not by a retry as such.
SQLSTATE_CHAIN_HEAD, SQLSTATE_CHAIN_ALIGN = "KV004", "KV005"
#: Columns of a StoredEvent, in order.
EVENT_COLUMNS = "position, stream_id, stream_version, type, payload, source_id, leader_epoch, recorded_at, chain_hash"
READ = f"SELECT {EVENT_COLUMNS} FROM events WHERE position >= $1 ORDER BY position LIMIT $2"
READ_STREAM = (f"SELECT {EVENT_COLUMNS} FROM events WHERE stream_id = $1 AND stream_version >= $2 "
               "ORDER BY stream_version LIMIT $3")
READ_STREAMS = f"SELECT {EVENT_COLUMNS} FROM events WHERE stream_id = ANY($1::text[]) ORDER BY position LIMIT $2"
#: What a replay needs of each event, and nothing more. The payload comes back as bytes
#: (``convert_to``: the stored UTF-8 as is), which the JSON decoder reads without the copy a
#: ``str`` costs it.
READ_PAYLOADS = ("SELECT position, convert_to(payload, 'UTF8') FROM events WHERE position >= $1 "
                 "ORDER BY position LIMIT $2")
#: The epoch bump and the renewal row, in one statement (one transaction). Updating ``leader``
#: waits for an append in flight (it holds the row ``FOR UPDATE``); the renewal row is
#: written after that (it reads ``bumped``), so an old leader's renewal is never blocked
#: by the wait, and one that runs after the bump matches no row. An upsert, so a missing
#: renewal row is recreated rather than leaving the new leader looking stale.
TAKE_LEADERSHIP = """
WITH bumped AS (
    UPDATE leader SET leader_epoch = leader_epoch + 1, holder = $1, since = now(), renewed_at = now()
    WHERE id = 1 RETURNING leader_epoch, holder, renewed_at
), renewal AS (
    INSERT INTO leader_renewal (id, leader_epoch, holder, renewed_at)
    SELECT 1, leader_epoch, holder, renewed_at FROM bumped
    ON CONFLICT (id) DO UPDATE
        SET leader_epoch = excluded.leader_epoch, holder = excluded.holder, renewed_at = excluded.renewed_at
    RETURNING leader_epoch
)
SELECT b.leader_epoch FROM bumped b JOIN renewal r ON r.leader_epoch = b.leader_epoch
"""
#: The leader's renewal: "UPDATE 1" while ``epoch`` ($1) is current, "UPDATE 0" once it was
#: superseded. It locks only the renewal row; the check on ``leader`` is a plain read (a
#: row locked ``FOR UPDATE`` by an append does not block it) and catches an epoch bumped
#: by anything that did not also rewrite the renewal row (an older coordinator, a hand edit).
RENEW_LEADERSHIP = ("UPDATE leader_renewal SET renewed_at = now() WHERE id = 1 AND leader_epoch = $1 "
                    "AND EXISTS (SELECT 1 FROM leader WHERE id = 1 AND leader_epoch = $1)")
#: holder, epoch, and whether the leader is stale ($1 = takeover_after_s). The renewal row
#: counts only for the current epoch; ``leader.renewed_at`` is what a coordinator older
#: than migration 0002 renews (``greatest`` ignores NULLs).
#: Standbys streaming from this server and whether commits wait for one. NOTE: any role may count
#: pg_stat_replication's rows (their details need pg_read_all_stats, which the writer lacks).
REPLICATION_STATUS = ("SELECT (SELECT count(*) FROM pg_stat_replication)::int, "
                      "current_setting('synchronous_standby_names') <> ''")

LEADER_STALE = """
SELECT l.holder, l.leader_epoch, coalesce(now() - greatest(l.renewed_at, r.renewed_at)
                                          > make_interval(secs => $1), true)
FROM leader l LEFT JOIN leader_renewal r ON r.id = 1 AND r.leader_epoch = l.leader_epoch
WHERE l.id = 1
"""
#: The leader row, with the renewal time of the current epoch only (as LEADER_STALE reads it).
LEADER_INFO = """
SELECT l.leader_epoch, l.holder, l.since, greatest(l.renewed_at, r.renewed_at)
FROM leader l LEFT JOIN leader_renewal r ON r.id = 1 AND r.leader_epoch = l.leader_epoch
WHERE l.id = 1
"""
LATEST_SNAPSHOT = ("SELECT position, state_hash, state, leader_epoch, created_at, chain_hash FROM snapshots "
                   "ORDER BY position DESC LIMIT 1")
#: The snapshot a replay "from the beginning" starts at once the log has been archived.
ARCHIVE_ANCHOR = ("SELECT a.last_position, s.state_hash, s.state, s.leader_epoch, s.created_at, s.chain_hash "
                  "FROM log_archives a "
                  "LEFT JOIN snapshots s ON s.position = a.last_position ORDER BY a.last_position DESC LIMIT 1")
ARCHIVED_UPTO = "SELECT coalesce(max(last_position), 0) FROM log_archives"
#: Where the stored chain starts: the newest archive's head (none: position 0, the genesis hash).
CHAIN_ANCHOR = "SELECT last_position, chain_hash FROM log_archives ORDER BY last_position DESC LIMIT 1"
#: The chain hash at a position (stored, or an archive's head).
CHAIN_AT = ("SELECT coalesce((SELECT chain_hash FROM events WHERE position = $1), "
            "(SELECT chain_hash FROM log_archives WHERE last_position = $1))")
SAVE_SNAPSHOT = ("INSERT INTO snapshots (position, state_hash, state, leader_epoch, chain_hash) "
                 "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (position) DO NOTHING")
SNAPSHOT_EXISTS = "SELECT 1 FROM snapshots WHERE position = $1"
SNAPSHOT_COLUMNS = ("position", "state_hash", "state", "leader_epoch", "chain_hash")
#: Snapshots at least this large are saved by COPY, streamed in pieces of ``STREAM_PIECE_BYTES``.
STREAM_SNAPSHOT_BYTES = 4 << 20
STREAM_PIECE_BYTES = 1 << 20
