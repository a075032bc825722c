#!/usr/bin/env bash
# The compose stack, run for real with the local container engine, then torn down:
#
#   bash deploy/smoke.sh            # ~10 min the first time (image builds), ~4 min after
#
# 1. tools and base images: podman-compose (>= 1.1, for compose's !reset and !override) from PATH,
#    else installed into a virtualenv of its own (KVL_SMOKE_TOOLS, default
#    ~/.cache/kvledger/smoke-tools) by pip; the public base images if KVL_PYTHON_IMAGE /
#    KVL_POSTGRES_IMAGE / KVL_NATS_IMAGE / KVL_PROMETHEUS_IMAGE / KVL_ALERTMANAGER_IMAGE name them,
#    else stand-ins built from localhost/debian:bookworm (deploy/standins; made by
#    ../shared/tools/container-engine.sh) — the real PostgreSQL, nats-server, Prometheus and
#    Alertmanager from Debian;
# 2. the kvledger images, tagged with the package's version and labelled with the commit
#    (a directory of wheels, KVL_WHEELS, default /opt/wheels when it exists, is mounted into the
#    build so the worker takes a CPU build of torch from it; the CA bundle pip uses here,
#    KVL_BUILD_CA, likewise); a YOCO checkpoint written by the worker image's
#    `kvledger model init --family yoco`, which the worker serves with fp8 cache storage;
# 3. compose.yaml + deploy/smoke/compose.cpu.yaml (worker-0 on the CPU, the alert receiver), a
#    throwaway env file of random secrets, one service at a time in compose's own order, each
#    waited for until its healthcheck passes (podman before 4.6 does not wait on
#    `condition: service_healthy`): postgres, postgres-standby (streaming from it), nats, nats-2,
#    nats-3 (a JetStream cluster, per-service credentials), migrate (must exit 0), coordinator,
#    coordinator-standby, worker-0, gateway, alert-receiver, alertmanager, prometheus;
# 4. completions through the gateway until one reports cached_tokens > 0, the same answer again;
#    a ~4,000-token prompt twice (the second from the cache, the same answer, YOCO's forms in the
#    pool); the audit through the admin API; the leader coordinator's container killed: the standby
#    takes over (timed), the worker carries on and a cached request still hits, the audit through
#    the new leader; Prometheus's KvlCoordinatorDown fires and Alertmanager delivers it to the
#    webhook receiver; the old leader started again comes back as the standby;
# 5. `down -v`: containers, network and volumes removed (also on failure; KVL_SMOKE_KEEP=1 keeps
#    them for a look, and prints the command that reaches them).
#
# Environment: ENGINE (podman), COMPOSE (podman-compose; `docker compose` works too),
# KVL_SMOKE_PROJECT (kvlsmoke), KVL_SMOKE_PORT_BASE (18300: gateway, +21 admin, +22 the standby's
# admin, +100 worker), KVL_SMOKE_ALERT_TIMEOUT (240 s for the alert to arrive).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-podman}
COMPOSE=${COMPOSE:-podman-compose}
PROJECT=${KVL_SMOKE_PROJECT:-kvlsmoke}
BASE=${KVL_SMOKE_PORT_BASE:-18300}
GATEWAY_PORT=$BASE ADMIN_PORT=$((BASE + 21)) STANDBY_PORT=$((BASE + 22)) WORKER_PORT=$((BASE + 100))
ALERT_TIMEOUT=${KVL_SMOKE_ALERT_TIMEOUT:-240}
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
REVISION=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
t0=$(date +%s)
say() { printf '[smoke %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
die() { say "FAILED: $*"; exit 1; }

command -v "$ENGINE" >/dev/null || die "$ENGINE not found (../shared/tools/container-engine.sh installs podman)"
if ! $COMPOSE version >/dev/null 2>&1; then
  [ "$COMPOSE" = podman-compose ] \
    || die "$COMPOSE does not run (COMPOSE names the compose front end: podman-compose, or 'docker compose')"
  tools=${KVL_SMOKE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvledger/smoke-tools}
  if [ ! -x "$tools/bin/podman-compose" ]; then
    say "podman-compose not on PATH: installing it into $tools (pip install 'podman-compose>=1.1,<2')"
    python3 -m venv "$tools" && "$tools/bin/pip" install -q 'podman-compose>=1.1,<2' \
      || die "installing podman-compose into $tools (or put podman-compose >= 1.1 on PATH)"
  fi
  COMPOSE="$tools/bin/podman-compose"
fi
say "compose front end: $COMPOSE ($($COMPOSE version 2>/dev/null | head -1))"

# --- 1. base images -------------------------------------------------------------------------------
standin() {  # $1: python|postgres|nats|prometheus|alertmanager -> prints the image to use
  local img="localhost/kvl-standin-$1:bookworm"
  if ! $ENGINE image exists "$img" 2>/dev/null; then
    $ENGINE image exists localhost/debian:bookworm 2>/dev/null \
      || { echo "no public registry here and no localhost/debian:bookworm: run ../shared/tools/container-engine.sh" >&2; return 1; }
    $ENGINE build -q --network host -t "$img" "deploy/standins/$1" >/dev/null || return 1
  fi
  echo "$img"
}
PYTHON_IMAGE=${KVL_PYTHON_IMAGE:-$(standin python)} || die "the python stand-in"
POSTGRES_IMAGE=${KVL_POSTGRES_IMAGE:-$(standin postgres)} || die "the postgres stand-in"
NATS_IMAGE=${KVL_NATS_IMAGE:-$(standin nats)} || die "the nats stand-in"
PROMETHEUS_IMAGE=${KVL_PROMETHEUS_IMAGE:-$(standin prometheus)} || die "the prometheus stand-in"
ALERTMANAGER_IMAGE=${KVL_ALERTMANAGER_IMAGE:-$(standin alertmanager)} || die "the alertmanager stand-in"
say "base images: $PYTHON_IMAGE, $POSTGRES_IMAGE, $NATS_IMAGE, $PROMETHEUS_IMAGE, $ALERTMANAGER_IMAGE"

# --- 2. kvledger images, the YOCO checkpoint ------------------------------------------------------
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

work=$(mktemp -d -t kvl-smoke.XXXXXX)
mkdir -p "$work/models"
# the worker image's own `kvledger model init` (as root: the directory is this machine's)
$ENGINE run --rm --user 0 --network none -v "$work/models:/models" "kvledger-worker:$VERSION" \
  kvledger model init /models/yoco --family yoco >/dev/null || die "kvledger model init --family yoco"
say "YOCO checkpoint written (kvledger model init --family yoco), served with fp8 cache storage"

# --- 3. the stack ---------------------------------------------------------------------------------
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
  echo "KVL_PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE"
  echo "KVL_ALERTMANAGER_IMAGE=$ALERTMANAGER_IMAGE"
  echo "KVL_MODELS_PATH=$work/models"
  echo "KVL_WORKER_MODEL_DIR=/models/yoco"
} > "$work/smoke.env"
# the published ports on free numbers (a developer's make up or another stack may hold 8300/8321/8400)
cat > "$work/ports.yaml" <<YAML
services:
  coordinator: {ports: !override ["127.0.0.1:$ADMIN_PORT:8321"]}
  coordinator-standby: {ports: !override ["127.0.0.1:$STANDBY_PORT:8321"]}
  worker-0: {ports: !override ["127.0.0.1:$WORKER_PORT:8400"]}
  gateway: {ports: !override ["127.0.0.1:$GATEWAY_PORT:8300"]}
  prometheus: {ports: !reset []}
  alertmanager: {ports: !reset []}
YAML
compose_args=(--env-file "$work/smoke.env" -p "$PROJECT" --profile monitoring -f compose.yaml
              -f deploy/smoke/compose.cpu.yaml -f "$work/ports.yaml")
dc() { $COMPOSE "${compose_args[@]}" "$@"; }
# what compose and podman print while starting (podman's notes on systemd and syslog among it) goes
# to a file, shown when a start fails
upd() { dc up -d --no-build "$@" >>"$work/compose.log" 2>&1 || { tail -n 20 "$work/compose.log"; die "compose up $*"; }; }
SERVICES="postgres postgres-standby nats nats-2 nats-3 migrate coordinator coordinator-standby worker-0 gateway
          alert-receiver alertmanager prometheus"
cleanup() {
  rc=$?
  if [ "$rc" != 0 ]; then
    for s in $SERVICES; do
      c=$(container "$s"); [ -n "$c" ] || continue   # not started yet
      echo "--- $s (last lines) ---"; $ENGINE logs --tail 30 "$c" 2>&1 | tail -30 || true
    done
  fi
  if [ "${KVL_SMOKE_KEEP:-0}" = 1 ]; then
    # as printed, from any directory: the repository, the env file and every -f
    local cmd; cmd="cd $(printf %q "$PWD") && $(printf '%q ' "$COMPOSE" "${compose_args[@]}")"
    say "kept; to look:   $cmd ps"
    say "kept; to remove: $cmd down -v && rm -rf $(printf %q "$work")"
    exit "$rc"
  fi
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
status_of() {  # $1 URL -> its HTTP status (000: nothing answers)
  python3 - "$1" <<'PY'
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=3).status)
except urllib.error.HTTPError as e:
    print(e.code)
except OSError:
    print("000")
PY
}
say "compose: project $PROJECT, gateway 127.0.0.1:$GATEWAY_PORT, admin :$ADMIN_PORT (standby :$STANDBY_PORT), worker :$WORKER_PORT"
up_started=$(date +%s)
upd postgres nats nats-2 nats-3
healthy postgres 90
# the synchronous standby streams before migrate's first commit can return
upd --no-deps postgres-standby
healthy postgres-standby 120
for n in nats nats-2 nats-3; do healthy "$n" 60; done   # the cluster: each node once JetStream has a leader
dc up --no-build --no-deps migrate >>"$work/compose.log" 2>&1 || true
m=$(container migrate)
code=$($ENGINE inspect -f '{{.State.ExitCode}}' "$m")
[ "$code" = 0 ] || die "migrate exited with $code"
say "migrate exited 0"
upd --no-deps coordinator
healthy coordinator 120
upd --no-deps coordinator-standby
healthy coordinator-standby 120
[ "$(status_of "http://127.0.0.1:$STANDBY_PORT/readyz")" = 503 ] || die "coordinator-standby's /readyz is not 503 (standby)"
upd --no-deps worker-0
healthy worker-0 240
upd --no-deps gateway
healthy gateway 120
upd --no-deps alert-receiver alertmanager prometheus
for s in alert-receiver alertmanager prometheus; do healthy "$s" 90; done
say "stack up in $(( $(date +%s) - up_started )) s"

# --- 4. requests, audits, a failover, an alert ----------------------------------------------------
client() { python3 deploy/smoke_client.py --gateway "http://127.0.0.1:$GATEWAY_PORT" --token "$ADMIN_TOKEN" "$@"; }
client --admin "http://127.0.0.1:$ADMIN_PORT" --phase before
client --admin "http://127.0.0.1:$ADMIN_PORT" --phase long

say "killing the leader coordinator's container (SIGKILL)"
leader=$(container coordinator)
$ENGINE kill "$leader" >>"$work/compose.log" 2>&1 || die "killing $leader"
killed=$(date +%s.%N)
deadline=$(( $(date +%s) + 60 ))
until [ "$(status_of "http://127.0.0.1:$STANDBY_PORT/readyz")" = 200 ]; do
  [ "$(date +%s)" -lt "$deadline" ] || die "coordinator-standby did not take over within 60 s"
  sleep 0.1
done
say "coordinator-standby leads: /readyz 200 $(python3 -c "import time; print(f'{time.time() - $killed:.1f}')") s after the kill"
client --admin "http://127.0.0.1:$STANDBY_PORT" --phase after

say "waiting for KvlCoordinatorDown to reach the webhook receiver (fires after 1 min down)"
receiver=$(container alert-receiver)
deadline=$(( $(date +%s) + ALERT_TIMEOUT ))
until $ENGINE logs "$receiver" 2>/dev/null | grep -q '"alert_received": "KvlCoordinatorDown", "status": "firing"'; do
  [ "$(date +%s)" -lt "$deadline" ] || die "no KvlCoordinatorDown alert reached the receiver within $ALERT_TIMEOUT s"
  sleep 5
done
say "alert delivered $(python3 -c "import time; print(f'{time.time() - $killed:.0f}')") s after the kill: $($ENGINE logs "$receiver" 2>/dev/null | grep KvlCoordinatorDown | head -1)"

$ENGINE start "$leader" >>"$work/compose.log" 2>&1 || die "starting $leader again"
deadline=$(( $(date +%s) + 120 ))
until [ "$(status_of "http://127.0.0.1:$ADMIN_PORT/healthz")" = 200 ]; do
  [ "$(date +%s)" -lt "$deadline" ] || die "the old leader did not come back within 120 s"
  sleep 1
done
[ "$(status_of "http://127.0.0.1:$ADMIN_PORT/readyz")" = 503 ] || die "the old leader, back, does not stand by"
[ "$(status_of "http://127.0.0.1:$STANDBY_PORT/readyz")" = 200 ] || die "the new leader stopped leading"
say "the old leader is back as the standby (/readyz 503), the new one still leads"
say "passed"
