"""The event log: events (append-only, guarded by triggers), snapshots, the leader row.

Revision ID: 0001
Revises:
Create Date: 2026-05-30
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# NOTE: statement-level BEFORE triggers fire even when no row matches, so `DELETE FROM
# events WHERE false` is refused too: the guard is about the attempt, not its effect. The
# table owner can still disable triggers; retention is by snapshot + archived partitions.
REFUSE_FUNCTION = """
CREATE FUNCTION kvl_refuse_log_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'kvledger: % on table "%" is refused: the event log is append-only',
        TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation',
              HINT = 'history is never edited; retention happens by snapshot and archived partitions';
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("stream_id", sa.Text(), nullable=False),
        sa.Column("stream_version", sa.BigInteger(), nullable=False),
        sa.Column("source_id", sa.Text(), nullable=True),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("leader_epoch", sa.BigInteger(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("position > 0", name="ck_events_position_positive"),
        sa.CheckConstraint("stream_version > 0", name="ck_events_stream_version_positive"),
        sa.PrimaryKeyConstraint("position", name="pk_events"),
        sa.UniqueConstraint("source_id", name="uq_events_source_id"),
        sa.UniqueConstraint("stream_id", "stream_version", name="uq_events_stream_id_stream_version"),
    )
    op.create_table(
        "snapshots",
        sa.Column("position", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("state_hash", sa.Text(), nullable=False),
        sa.Column("state", sa.LargeBinary(), nullable=False),
        sa.Column("leader_epoch", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("position", name="pk_snapshots"),
    )
    op.create_table(
        "leader",
        sa.Column("id", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("leader_epoch", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("id = 1", name="ck_leader_singleton"),
        sa.PrimaryKeyConstraint("id", name="pk_leader"),
    )
    op.execute("INSERT INTO leader (id, leader_epoch, holder) VALUES (1, 0, '')")
    op.execute(REFUSE_FUNCTION)
    op.execute("CREATE TRIGGER events_refuse_update_delete BEFORE UPDATE OR DELETE ON events "
               "FOR EACH STATEMENT EXECUTE FUNCTION kvl_refuse_log_change()")
    op.execute("CREATE TRIGGER events_refuse_truncate BEFORE TRUNCATE ON events "
               "FOR EACH STATEMENT EXECUTE FUNCTION kvl_refuse_log_change()")
    op.execute("CREATE TRIGGER snapshots_refuse_update BEFORE UPDATE ON snapshots "
               "FOR EACH STATEMENT EXECUTE FUNCTION kvl_refuse_log_change()")


def downgrade() -> None:
    # Dropping the log loses history: refuse unless it is empty.
    op.execute("""
        DO $$ BEGIN
            IF EXISTS (SELECT 1 FROM events) THEN
                RAISE EXCEPTION 'kvledger: refusing to drop a non-empty event log';
            END IF;
        END $$""")
    op.drop_table("leader")
    op.drop_table("snapshots")
    op.drop_table("events")
    op.execute("DROP FUNCTION kvl_refuse_log_change()")
