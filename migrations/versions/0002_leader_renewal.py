"""leader_renewal: the leader's renewal timestamp on a row that appends never lock.

Every append locks the ``leader`` row ``FOR UPDATE`` (the fencing check), so a renewal
that updated ``leader.renewed_at`` waited behind any append in flight: a slow append made
the renewal time out and the leader step down. Renewals now update this one-row table;
``leader.leader_epoch`` stays the fencing token. The row starts as a copy of ``leader``.

``leader.renewed_at`` is kept (an older coordinator still running during a rolling upgrade
renews it; the new staleness check reads the later of the two), so the downgrade only
copies the last renewal back and drops the table.

Revision ID: 0002
Revises: 0001
Create Date: 2026-06-01
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "leader_renewal",
        sa.Column("id", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("leader_epoch", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("id = 1", name="ck_leader_renewal_singleton"),
        sa.PrimaryKeyConstraint("id", name="pk_leader_renewal"),
    )
    # A plain read of `leader` (no row lock): never waits for an append in flight.
    op.execute("INSERT INTO leader_renewal (id, leader_epoch, holder, renewed_at) "
               "SELECT id, leader_epoch, holder, renewed_at FROM leader WHERE id = 1")


def downgrade() -> None:
    # Keep the leader's last renewal where the older code looks for it. This waits for an
    # append in flight (it updates the row appends lock), like the older renewals did.
    op.execute("""
        UPDATE leader l SET renewed_at = r.renewed_at FROM leader_renewal r
        WHERE l.id = 1 AND r.id = 1 AND r.leader_epoch = l.leader_epoch
          AND r.renewed_at IS NOT NULL AND (l.renewed_at IS NULL OR r.renewed_at > l.renewed_at)""")
    op.drop_table("leader_renewal")
