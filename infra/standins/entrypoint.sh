#!/bin/sh
# No command (or `postgres`): PostgreSQL as the official image runs it; anything else is run as is.
set -e
if [ "$#" -gt 0 ] && [ "$1" != postgres ]; then
  exec "$@"
fi
bin=/usr/lib/postgresql/15/bin
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
password="${POSTGRES_PASSWORD:-}"
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
  password="$(cat "$POSTGRES_PASSWORD_FILE")"
fi
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile="$(mktemp)"
  printf '%s\n' "$password" > "$pwfile"
  chown postgres "$pwfile"
  su postgres -s /bin/sh -c "$bin/initdb -D '$PGDATA' -U '$user' --pwfile='$pwfile' -E UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256" >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\" OWNER \"$user\";" \
      | su postgres -s /bin/sh -c "$bin/postgres --single -D '$PGDATA' postgres" >/dev/null
  fi
fi
exec su postgres -s /bin/sh -c "exec $bin/postgres -D '$PGDATA'"
