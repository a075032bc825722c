#!/bin/sh
# Initialise PGDATA on first start (superuser POSTGRES_USER with POSTGRES_PASSWORD, database
# POSTGRES_DB, scram-sha-256 over the network), then run the server in the foreground.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
USER_NAME="${POSTGRES_USER:-postgres}"
DB_NAME="${POSTGRES_DB:-$USER_NAME}"
chown -R postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" > "$pwfile"
  chown postgres "$pwfile"
  su postgres -s /bin/sh -c "initdb -D '$PGDATA' -U '$USER_NAME' --pwfile='$pwfile' --auth-local=trust --auth-host=scram-sha-256" >/dev/null
  rm -f "$pwfile"
  echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
  echo "host all all ::/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$DB_NAME" != "postgres" ]; then
    su postgres -s /bin/sh -c "postgres --single -D '$PGDATA' postgres" >/dev/null <<SQL
CREATE DATABASE "$DB_NAME" OWNER "$USER_NAME";
SQL
  fi
  # /docker-entrypoint-initdb.d/*.sh as the official image runs them (compose.yaml's replication
  # role and slot): once, on a server reachable only through its socket, as the server's user.
  if ls /docker-entrypoint-initdb.d/*.sh >/dev/null 2>&1; then
    export POSTGRES_USER="$USER_NAME" POSTGRES_DB="$DB_NAME" PGDATA
    su postgres -s /bin/sh -c "pg_ctl -D '$PGDATA' -o \"-c listen_addresses=''\" -w start" >/dev/null
    for f in /docker-entrypoint-initdb.d/*.sh; do
      su postgres -s /bin/sh -c "sh '$f'"
    done
    su postgres -s /bin/sh -c "pg_ctl -D '$PGDATA' -m fast -w stop" >/dev/null
  fi
fi
# setpriv execs the server itself (no su in between): it gets the signals compose sends
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA"
