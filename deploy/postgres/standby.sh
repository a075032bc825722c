#!/bin/sh
# compose.yaml's postgres-standby: cloned from postgres on its first start (pg_basebackup -R writes
# standby.signal and primary_conninfo), then a hot standby streaming from it through the slot
# kvl_standby as the role kvledger_replication. Promote it with
#   docker compose exec postgres-standby pg_ctl promote -D /var/lib/postgresql/data/pgdata
# (docs/operations.md, "PostgreSQL standby and failover").
set -eu
umask 077
pass=/var/lib/postgresql/data/replication.pgpass   # the password never lands in postgresql.auto.conf
printf '*:*:*:kvledger_replication:%s\n' "$KVL_PG_REPLICATION_PASSWORD" > "$pass"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  rm -rf "$PGDATA"   # what a clone that failed halfway left
  pg_basebackup -D "$PGDATA" -X stream -S kvl_standby -R -c fast -w \
    -d "host=postgres port=5432 user=kvledger_replication application_name=kvl_standby passfile=$pass"
fi
# Promoted, it must not wait for a standby of its own: the clone copied the primary's setting.
exec postgres -c synchronous_standby_names= -c hot_standby=on \
  -c password_encryption=scram-sha-256 -c unix_socket_permissions=0700
