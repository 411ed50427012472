#!/bin/sh
# First start of the compose stack: a join token, a client API key, an admin key, the service
# token (services present it to each other; it signs worker credentials) and the PostgreSQL
# password, generated once into the `secrets` volume (mounted read-only at
# /run/pdserve in the services). Later starts keep them. Rotate by editing the files: pdserve
# re-reads key and token files without a restart.
set -eu
dir=/run/pdserve
new() { od -An -tx1 -N24 /dev/urandom | tr -d ' \n'; }
umask 022
[ -s "$dir/join-token" ] || new > "$dir/join-token"
[ -s "$dir/api-keys" ] || echo "$(new) default" > "$dir/api-keys"
[ -s "$dir/admin-keys" ] || echo "$(new) operator" > "$dir/admin-keys"
[ -s "$dir/service-tokens" ] || new > "$dir/service-tokens"
[ -s "$dir/postgres-password" ] || new > "$dir/postgres-password"
echo "secrets in $dir: $(ls "$dir" | tr '\n' ' ')"
