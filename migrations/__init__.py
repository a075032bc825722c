"""Alembic migrations of the coordinator's event log (``kvledger db upgrade``)."""
