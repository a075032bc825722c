#!/bin/sh
# compose.yaml's postgres, once, when its volume is created (/docker-entrypoint-initdb.d): the
# standby's own role (REPLICATION and LOGIN, nothing else; SCRAM password KVL_PG_REPLICATION_PASSWORD),
# its physical slot, a pg_hba line that lets that role, and no other, replicate, and - unless
# KVL_PG_SYNCHRONOUS_STANDBY is off - the standby named synchronous: a commit returns once the
# standby has flushed it (docs/operations.md, "PostgreSQL standby and failover").
# NOTE: ALTER SYSTEM, not the command line: the setting takes effect at the server's real start,
# after this script (a commit here would otherwise wait for a standby that does not exist yet).
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     -v pw="$KVL_PG_REPLICATION_PASSWORD" <<'SQL'
SELECT format('CREATE ROLE kvledger_replication LOGIN REPLICATION PASSWORD %L', :'pw') \gexec
SELECT pg_create_physical_replication_slot('kvl_standby');
SQL
echo "host replication kvledger_replication all scram-sha-256" >> "$PGDATA/pg_hba.conf"
if [ "${KVL_PG_SYNCHRONOUS_STANDBY:-on}" != off ]; then
  psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
       -c "ALTER SYSTEM SET synchronous_standby_names = 'kvl_standby'"
fi
