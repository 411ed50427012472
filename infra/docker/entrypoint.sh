#!/bin/sh
# `pdserve ARGS` in a container. With PDSERVE_DATABASE_PASSWORD_FILE set, the password in that
# file replaces `{password}` in PDSERVE_DATABASE_URL, so that no password is written in a compose
# file or shows in `docker inspect` (the compose stack generates it at first start).
set -e
if [ -n "${PDSERVE_DATABASE_PASSWORD_FILE:-}" ]; then
  password="$(cat "$PDSERVE_DATABASE_PASSWORD_FILE")"
  PDSERVE_DATABASE_URL="$(printf '%s' "${PDSERVE_DATABASE_URL:-}" | sed "s|{password}|$password|")"
  export PDSERVE_DATABASE_URL
  unset PDSERVE_DATABASE_PASSWORD_FILE
fi
exec pdserve "$@"
