#!/usr/bin/env bash
# The compose stack brought up for real, checked, and removed. Needs a Docker engine, docker
# compose v2, and (where no registry is reachable) root and mmdebstrap for the base image.
#
#   scripts/compose_smoke.sh            exit 0 only if every check holds
#
# 1. builds the images once: the base image from the Debian mirror (scripts/build_base_image.sh,
#    unless PDSERVE_SMOKE_BASE_IMAGE names one), pdserve, and stand-ins for the official Redis,
#    Postgres and Prometheus images (infra/standins: no registry to pull them from);
# 2. brings the stack up with the `smoke` profile (an OTLP receiver that records spans instead of
#    the OpenTelemetry Collector, Jaeger and Grafana) and waits for every service's health;
# 3. runs scripts/compose_smoke_checks.py: 50 OpenAI requests through the router's published port,
#    every Prometheus target up, a trace through router, coordinator, prefill and decode, the
#    decode pool scaled up through the governor (a new worker container READY) and down again
#    (exactly the drained container removed, no request failed);
# 4. tears everything down: worker containers, the stack, its volumes and network, the images it
#    built (PDSERVE_SMOKE_KEEP_IMAGES=1 keeps them for a faster next run).
#
# Extra CA certificates for pip inside the build: PDSERVE_COMPOSE_EXTRA_CA_FILE, else the
# machine's own (/usr/local/share/ca-certificates/*.crt) when there are any.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=$(date +%s)
log() { echo "[compose-smoke $(( $(date +%s) - started ))s] $*"; }

project="pdserve-smoke"
export COMPOSE_PROJECT_NAME="$project" COMPOSE_PROFILES=smoke
export PDSERVE_COMPOSE_NETWORK="$project"
export PDSERVE_COMPOSE_IMAGE="pdserve:smoke"
export PDSERVE_COMPOSE_STANDIN_IMAGE="pdserve-standins:smoke"
export PDSERVE_COMPOSE_REDIS_IMAGE="$PDSERVE_COMPOSE_STANDIN_IMAGE"
export PDSERVE_COMPOSE_POSTGRES_IMAGE="$PDSERVE_COMPOSE_STANDIN_IMAGE"
export PDSERVE_COMPOSE_PROMETHEUS_IMAGE="$PDSERVE_COMPOSE_STANDIN_IMAGE"
export PDSERVE_COMPOSE_OTLP_ENDPOINT="http://otlp-recorder:4317"
export PDSERVE_COMPOSE_OTEL_SAMPLING_RATIO=1.0
export PDSERVE_COMPOSE_AUTOSCALE_INTERVAL_S=3
export PDSERVE_COMPOSE_WORKER_READY_TIMEOUT_S=120
# Every request must complete: no early load shedding (a loaded CI machine misses the TTFT SLO;
# shedding is tested in tests/e2e/test_overload.py).
export PDSERVE_COMPOSE_IS_SHEDDING_ENABLED=false

workdir="$(mktemp -d)"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
for name in HTTP GRPC PREFILL_POOL DECODE_POOL GOVERNOR PROMETHEUS RECORDER; do
  export "PDSERVE_COMPOSE_${name}_PORT=$(free_port)"
done
if [ -z "${PDSERVE_COMPOSE_EXTRA_CA_FILE:-}" ] && compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cat /usr/local/share/ca-certificates/*.crt > "$workdir/extra-ca.pem"
  export PDSERVE_COMPOSE_EXTRA_CA_FILE="$workdir/extra-ca.pem"
fi

base_image="${PDSERVE_SMOKE_BASE_IMAGE:-local/debian:bookworm}"
built_base=""
images=("$PDSERVE_COMPOSE_IMAGE" "$PDSERVE_COMPOSE_STANDIN_IMAGE")

remove_workers() {
  local ids
  ids="$(docker ps -aq --filter "label=io.pdserve.scope=$PDSERVE_COMPOSE_NETWORK")"
  if [ -n "$ids" ]; then
    # shellcheck disable=SC2086
    docker rm -f $ids >/dev/null
  fi
}

cleanup() {
  local rc=$?
  set +e
  if [ "$rc" -ne 0 ]; then
    log "FAILED (exit $rc): the last lines of every service"
    docker compose logs --no-color --tail 15 2>&1 | cut -c1-400 | tail -200
    for id in $(docker ps -aq --filter "label=io.pdserve.scope=$PDSERVE_COMPOSE_NETWORK"); do
      echo "--- worker container $(docker inspect -f '{{.Name}}' "$id")"
      docker logs --tail 15 "$id" 2>&1 | cut -c1-400
    done
  fi
  log "tearing down"
  # The pool managers first (they remove the worker containers they started), then whatever is
  # left of the workers, then the stack with its volumes and network.
  docker compose stop --timeout 60 prefill-pool decode-pool >/dev/null 2>&1
  remove_workers
  docker compose down --volumes --remove-orphans --timeout 20 >/dev/null 2>&1
  remove_workers
  if [ -z "${PDSERVE_SMOKE_KEEP_IMAGES:-}" ]; then
    docker image rm "${images[@]}" >/dev/null 2>&1
    [ -n "$built_base" ] && docker image rm "$base_image" >/dev/null 2>&1
  fi
  rm -rf "$workdir"
  log "done (exit $rc)"
  exit "$rc"
}
trap cleanup EXIT

command -v docker >/dev/null || { echo "docker is missing" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "no Docker engine answers" >&2; exit 1; }
docker compose version >/dev/null || { echo "docker compose v2 is missing" >&2; exit 1; }

if ! docker image inspect "$base_image" >/dev/null 2>&1; then
  log "building the base image $base_image from the Debian mirror"
  scripts/build_base_image.sh "$base_image"
  built_base=1
fi
export PDSERVE_COMPOSE_BASE_IMAGE="$base_image"
log "building images: ${images[*]}"
docker compose -f infra/standins/compose.yml build --quiet
docker compose build --quiet

log "bringing the stack up"
docker compose up --detach --wait --wait-timeout 300 --quiet-pull
log "stack healthy: $(docker compose ps --format '{{.Service}}' | tr '\n' ' ')"

api_key="$(docker compose exec -T router cut -d' ' -f1 /run/pdserve/api-keys)"
admin_key="$(docker compose exec -T router cut -d' ' -f1 /run/pdserve/admin-keys)"
docker run --rm --network host --user root \
  -v "$PWD/scripts/compose_smoke_checks.py:/compose_smoke_checks.py:ro" \
  -v /var/run/docker.sock:/var/run/docker.sock \
  --entrypoint python "$PDSERVE_COMPOSE_IMAGE" /compose_smoke_checks.py \
  --http-port "$PDSERVE_COMPOSE_HTTP_PORT" \
  --prefill-pool-port "$PDSERVE_COMPOSE_PREFILL_POOL_PORT" \
  --decode-pool-port "$PDSERVE_COMPOSE_DECODE_POOL_PORT" \
  --governor-port "$PDSERVE_COMPOSE_GOVERNOR_PORT" \
  --prometheus-port "$PDSERVE_COMPOSE_PROMETHEUS_PORT" \
  --recorder-port "$PDSERVE_COMPOSE_RECORDER_PORT" \
  --api-key "$api_key" --admin-key "$admin_key" --scope "$PDSERVE_COMPOSE_NETWORK"
log "all checks passed"
