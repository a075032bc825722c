#!/usr/bin/env bash
# The compose stack, run for real with the local container engine, then torn down:
#
#   bash deploy/smoke.sh            # ~10 min the first time (image builds), ~3 min after
#
# 1. base images: the public ones if KVL_PYTHON_IMAGE / KVL_POSTGRES_IMAGE / KVL_NATS_IMAGE name
#    them, else stand-ins built from localhost/debian:bookworm (deploy/standins; made by
#    ../shared/tools/container-engine.sh) — the real PostgreSQL and nats-server from Debian;
# 2. the kvledger images, tagged with the package's version and labelled with the commit
#    (a directory of wheels, KVL_WHEELS, default /opt/wheels when it exists, is mounted into the
#    build so the worker takes a CPU build of torch from it; the CA bundle pip uses here,
#    KVL_BUILD_CA, likewise);
# 3. compose.yaml + deploy/smoke/compose.cpu.yaml (worker-0 on the CPU), a throwaway env file of
#    random secrets, one service at a time in compose's own order, each waited for until its
#    healthcheck passes (podman before 4.6 does not wait on `condition: service_healthy`):
#    postgres, postgres-standby (streaming from it), nats, nats-2, nats-3 (a JetStream cluster, per-service credentials), migrate (must exit 0), coordinator,
#    worker-0, gateway;
# 4. completions through the gateway until one reports cached_tokens > 0, the same answer again;
#    the audit through the admin API; the coordinator container restarted; the worker carries on
#    (same epoch or a resume) and a cached request still hits; the audit again;
# 5. `down -v`: containers, network and volumes removed (also on failure; KVL_SMOKE_KEEP=1 keeps
#    them for a look).
#
# Environment: ENGINE (podman), COMPOSE (podman-compose; `docker compose` works too),
# KVL_SMOKE_PROJECT (kvlsmoke), KVL_SMOKE_PORT_BASE (18300: gateway, +21 admin, +100 worker).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-podman}
COMPOSE=${COMPOSE:-podman-compose}
PROJECT=${KVL_SMOKE_PROJECT:-kvlsmoke}
BASE=${KVL_SMOKE_PORT_BASE:-18300}
GATEWAY_PORT=$BASE ADMIN_PORT=$((BASE + 21)) WORKER_PORT=$((BASE + 100))
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
REVISION=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
t0=$(date +%s)
say() { printf '[smoke %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
die() { say "FAILED: $*"; exit 1; }

command -v "$ENGINE" >/dev/null || die "$ENGINE not found (../shared/tools/container-engine.sh installs podman)"
if ! $COMPOSE version >/dev/null 2>&1; then
  die "$COMPOSE not found: pip install podman-compose (>= 1.1: it reads compose's !reset), or COMPOSE='docker compose'"
fi

# --- 1. base images -------------------------------------------------------------------------------
standin() {  # $1: python|postgres|nats -> prints the image to use
  local img="localhost/kvl-standin-$1:bookworm"
  if ! $ENGINE image exists "$img" 2>/dev/null; then
    $ENGINE image exists localhost/debian:bookworm 2>/dev/null \
      || die "no public registry here and no localhost/debian:bookworm: run ../shared/tools/container-engine.sh"
    $ENGINE build -q --network host -t "$img" "deploy/standins/$1" >/dev/null
  fi
  echo "$img"
}
PYTHON_IMAGE=${KVL_PYTHON_IMAGE:-$(standin python)}
POSTGRES_IMAGE=${KVL_POSTGRES_IMAGE:-$(standin postgres)}
NATS_IMAGE=${KVL_NATS_IMAGE:-$(standin nats)}
say "base images: $PYTHON_IMAGE, $POSTGRES_IMAGE, $NATS_IMAGE"

# --- 2. kvledger images ---------------------------------------------------------------------------
WHEELS=${KVL_WHEELS:-/opt/wheels}
build_args=(--network host --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" --build-arg "VERSION=$VERSION"
            --build-arg "GIT_REVISION=$REVISION")
if [ -d "$WHEELS" ]; then build_args+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels); fi
# pip inside the build trusts what pip here trusts (a proxy that re-signs TLS needs its CA)
CA=${KVL_BUILD_CA:-${PIP_CERT:-$(pip3 config get global.cert 2>/dev/null || true)}}
if [ -n "$CA" ] && [ -f "$CA" ]; then build_args+=(-v "$CA:/etc/kvl-build-ca.crt:ro" --build-arg PIP_CERT=/etc/kvl-build-ca.crt); fi
for target in coordinator worker; do
  say "building kvledger-$target:$VERSION ($REVISION)"
  $ENGINE build -q "${build_args[@]}" --target "$target" -t "kvledger-$target:$VERSION" . >/dev/null \
    || die "building the $target image"
done

# --- 3. the stack ---------------------------------------------------------------------------------
work=$(mktemp -d -t kvl-smoke.XXXXXX)
# NOTE: a letter first: nats-server reads a password from its environment as a config value, and
# one that starts with a digit parses as a number and stops the server (nats-server#3431, #6891)
secret() { python3 -c 'import secrets; print("k" + secrets.token_hex(16))'; }
ADMIN_TOKEN=$(secret)
{
  for v in POSTGRES_PASSWORD KVL_APP_DB_PASSWORD KVL_PG_REPLICATION_PASSWORD NATS_PASSWORD_COORDINATOR NATS_PASSWORD_OPERATOR \
           NATS_PASSWORD_OBSERVER NATS_PASSWORD_WORKER_WORKER_0 NATS_PASSWORD_WORKER_WORKER_1 \
           NATS_PASSWORD_GATEWAY_GATEWAY NATS_ROUTE_PASSWORD KVL_SALT_SECRET KVL_GATEWAY_SECRET; do echo "$v=$(secret)"; done
  echo "KVL_ADMIN_TOKEN=$ADMIN_TOKEN"
  echo "KVL_VERSION=$VERSION"
  echo "KVL_GIT_REVISION=$REVISION"
  echo "KVL_PYTHON_IMAGE=$PYTHON_IMAGE"
  echo "KVL_POSTGRES_IMAGE=$POSTGRES_IMAGE"
  echo "KVL_NATS_IMAGE=$NATS_IMAGE"
  echo "KVL_MODELS_PATH=$work/models"
} > "$work/smoke.env"
mkdir -p "$work/models"
# the published ports on free numbers (a developer's make up or another stack may hold 8300/8321/8400)
cat > "$work/ports.yaml" <<YAML
services:
  coordinator: {ports: !override ["127.0.0.1:$ADMIN_PORT:8321"]}
  worker-0: {ports: !override ["127.0.0.1:$WORKER_PORT:8400"]}
  gateway: {ports: !override ["127.0.0.1:$GATEWAY_PORT:8300"]}
YAML
dc() { $COMPOSE --env-file "$work/smoke.env" -p "$PROJECT" -f compose.yaml -f deploy/smoke/compose.cpu.yaml \
         -f "$work/ports.yaml" "$@"; }
cleanup() {
  rc=$?
  if [ "$rc" != 0 ]; then
    for s in postgres postgres-standby nats nats-2 nats-3 migrate coordinator worker-0 gateway; do
      echo "--- $s (last lines) ---"; dc logs --tail 30 "$s" 2>/dev/null | tail -30 || true
    done
  fi
  if [ "${KVL_SMOKE_KEEP:-0}" = 1 ]; then say "kept: $COMPOSE -p $PROJECT ... (env $work/smoke.env)"; exit "$rc"; fi
  dc down -v >/dev/null 2>&1 || true
  rm -rf "$work"
  say "torn down"
  exit "$rc"
}
trap cleanup EXIT

container() { $ENGINE ps -a --filter "label=com.docker.compose.project=$PROJECT" \
                --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1; }
healthy() {  # $1 service, $2 seconds
  local c deadline=$(( $(date +%s) + $2 ))
  c=$(container "$1"); [ -n "$c" ] || die "no container for $1"
  until $ENGINE healthcheck run "$c" >/dev/null 2>&1; do
    [ "$($ENGINE inspect -f '{{.State.Running}}' "$c")" = true ] || die "$1 exited"
    [ "$(date +%s)" -lt "$deadline" ] || die "$1 not healthy within $2 s"
    sleep 2
  done
  say "$1 healthy"
}
say "compose: project $PROJECT, gateway 127.0.0.1:$GATEWAY_PORT, admin :$ADMIN_PORT, worker :$WORKER_PORT"
dc up -d --no-build postgres nats nats-2 nats-3 >/dev/null
healthy postgres 90
# the synchronous standby streams before migrate's first commit can return
dc up -d --no-build --no-deps postgres-standby >/dev/null
healthy postgres-standby 120
for n in nats nats-2 nats-3; do healthy "$n" 60; done   # the cluster: each node once JetStream has a leader
dc up --no-build --no-deps migrate >/dev/null 2>&1 || true
m=$(container migrate)
code=$($ENGINE inspect -f '{{.State.ExitCode}}' "$m")
[ "$code" = 0 ] || die "migrate exited with $code"
say "migrate exited 0"
dc up -d --no-build --no-deps coordinator >/dev/null
healthy coordinator 120
dc up -d --no-build --no-deps worker-0 >/dev/null
healthy worker-0 240
dc up -d --no-build --no-deps gateway >/dev/null
healthy gateway 120

# --- 4. requests, audits, a coordinator restart ---------------------------------------------------
python3 deploy/smoke_client.py --gateway "http://127.0.0.1:$GATEWAY_PORT" --admin "http://127.0.0.1:$ADMIN_PORT" \
  --token "$ADMIN_TOKEN" --phase before
say "restarting the coordinator container"
$ENGINE restart "$(container coordinator)" >/dev/null
healthy coordinator 120
python3 deploy/smoke_client.py --gateway "http://127.0.0.1:$GATEWAY_PORT" --admin "http://127.0.0.1:$ADMIN_PORT" \
  --token "$ADMIN_TOKEN" --phase after
say "passed"
