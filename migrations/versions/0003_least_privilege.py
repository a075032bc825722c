"""least_privilege: snapshots append-only too, and the ``kvledger_writer`` group role.

The coordinator used to connect as the schema owner (often a superuser), and the owner can
switch the append-only guard off (``SET session_replication_role = replica``, ``ALTER TABLE
… DISABLE TRIGGER``). This revision gives the coordinator a role that cannot:

* ``snapshots`` refuses DELETE and TRUNCATE as well as UPDATE (the coordinator only ever
  inserts snapshots and reads the latest one; it never prunes them, so no privileged
  deletion path is needed).
* ``kvledger_writer`` (NOLOGIN, cluster-wide, created if missing) holds exactly what the
  statements of :mod:`coordinator.log.postgres` and :mod:`coordinator.log.leader` need:
  INSERT + SELECT on ``events`` and ``snapshots``; SELECT + UPDATE on ``leader`` (the
  fencing lock ``FOR UPDATE`` and the epoch bump); SELECT + INSERT + UPDATE on
  ``leader_renewal`` (the takeover's upsert recreates a missing row); SELECT on the
  Alembic version table (the coordinator checks that the schema is at head); USAGE on the
  schema. No ownership, no TRUNCATE, no DDL. The tables have no sequences (positions are
  computed under the leader lock). Advisory locks need no privilege; ``pg_terminate_backend``
  of a stale leader's sessions works between sessions of the *same login role*, so every
  coordinator of one ledger logs in as the same member of ``kvledger_writer``.
* CREATE on the schema is revoked from PUBLIC (already so by default since PostgreSQL 15),
  so the writer cannot create objects next to the log.

Login roles are not created here (they need a password): ``coordinator.log.roles``
creates one and grants it ``kvledger_writer`` (``kvledger up`` and compose's ``migrate``
do this). The role is created only if missing, which needs CREATEROLE; a migrating role
without it needs ``CREATE ROLE kvledger_writer NOLOGIN`` done beforehand by an administrator.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""
from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WRITER_ROLE = "kvledger_writer"

# Roles are cluster-wide: several databases (or test runs) may create it at the same time.
CREATE_WRITER = f"""
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{WRITER_ROLE}') THEN
        CREATE ROLE {WRITER_ROLE} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END $$"""

# (table, privileges). Everything else on these tables is revoked first, so re-running the
# grants (or a role that existed with more) ends with exactly this.
GRANTS = (
    ("events", "SELECT, INSERT"),
    ("snapshots", "SELECT, INSERT"),
    ("leader", "SELECT, UPDATE"),
    ("leader_renewal", "SELECT, INSERT, UPDATE"),
)


def _version_table() -> str:
    ctx = op.get_context()
    name = getattr(ctx, "version_table", "alembic_version")
    schema = getattr(ctx, "version_table_schema", None)
    return f'"{schema}"."{name}"' if schema else f'"{name}"'


def upgrade() -> None:
    op.execute("CREATE TRIGGER snapshots_refuse_delete BEFORE DELETE ON snapshots "
               "FOR EACH STATEMENT EXECUTE FUNCTION kvl_refuse_log_change()")
    op.execute("CREATE TRIGGER snapshots_refuse_truncate BEFORE TRUNCATE ON snapshots "
               "FOR EACH STATEMENT EXECUTE FUNCTION kvl_refuse_log_change()")
    op.execute(CREATE_WRITER)
    op.execute(f"""
        DO $$ BEGIN
            EXECUTE format('GRANT USAGE ON SCHEMA %I TO {WRITER_ROLE}', current_schema());
            -- no-op since PostgreSQL 15; a WARNING (not an error) where we may not revoke it
            EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', current_schema());
        END $$""")
    for table, privileges in GRANTS:
        op.execute(f"REVOKE ALL ON {table} FROM {WRITER_ROLE}")
        op.execute(f"GRANT {privileges} ON {table} TO {WRITER_ROLE}")
    op.execute(f"REVOKE ALL ON {_version_table()} FROM {WRITER_ROLE}")
    op.execute(f"GRANT SELECT ON {_version_table()} TO {WRITER_ROLE}")


def downgrade() -> None:
    # The role itself stays: it is cluster-wide and may hold grants in other databases.
    for table, _ in GRANTS:
        op.execute(f"REVOKE ALL ON {table} FROM {WRITER_ROLE}")
    op.execute(f"REVOKE ALL ON {_version_table()} FROM {WRITER_ROLE}")
    op.execute(f"DO $$ BEGIN EXECUTE format('REVOKE ALL ON SCHEMA %I FROM {WRITER_ROLE}', current_schema()); END $$")
    op.execute("DROP TRIGGER snapshots_refuse_truncate ON snapshots")
    op.execute("DROP TRIGGER snapshots_refuse_delete ON snapshots")
