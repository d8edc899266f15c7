#!/usr/bin/env bash
# The compose test: `docker compose up` of deploy/docker-compose.yml on this machine's Docker
# engine, a request through the published port, its spans checked at the OTLP receiver, and a
# clean `docker compose down`.
#
# Nothing is pulled: the runtime base image (debian:bookworm-slim) is built with debootstrap when
# the engine lacks it, the pdmesh image is built from the binaries built on the host
# (PREBUILT build argument), and Jaeger is stood in for by our own OTLP receiver
# (pdmesh-otlp-sink, same image) through an override file. The mesh runs on the synthetic
# executor (deploy/topology/compose-synthetic.toml), so no model file is needed.
#
# Skips (exit 0, with the reason) when there is no Docker engine or no compose.
set -euo pipefail
cd "$(dirname "$0")/.."

skip() { echo "compose-test: SKIPPED: $*"; exit 0; }
command -v docker >/dev/null 2>&1 || skip "no docker client"
docker info >/dev/null 2>&1 || skip "no Docker engine reachable"
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then COMPOSE=(docker-compose)
else skip "neither 'docker compose' nor 'docker-compose' is installed"; fi

started=$(date +%s)
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
IMAGE="pdmesh:compose-test"
PROJECT="pdmesh-ci-$$"
WORK="$(mktemp -d)"

# ---- 1. the base image, built locally when missing
if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
  echo "compose-test: building debian:bookworm-slim with debootstrap (no image is pulled)"
  if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null
  fi
  debootstrap --variant=minbase bookworm "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  tar -C "$WORK/rootfs" -c . | docker import - debian:bookworm-slim >/dev/null
  rm -rf "$WORK/rootfs"
fi

# ---- 2. the image, from the host-built binaries
# --workspace: the build the test run already made (a `-p` build resolves features anew and
# rebuilds third-party crates)
cargo build --release --workspace --bins
mkdir -p deploy/.prebuilt
cp "$TARGET_DIR/release/pdmesh" "$TARGET_DIR/release/pdmesh-otlp-sink" deploy/.prebuilt/
docker build -q -f deploy/Dockerfile -t "$IMAGE" \
  --build-arg RUST_IMAGE=debian:bookworm-slim --build-arg PREBUILT=deploy/.prebuilt . >/dev/null

# ---- 3. compose up, with our OTLP receiver in Jaeger's place
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
export PDMESH_IMAGE="$IMAGE" PDMESH_COMPOSE_TOPOLOGY=/etc/pdmesh/compose-synthetic.toml
export PDMESH_HTTP_PORT="$(free_port)" JAEGER_UI_PORT="$(free_port)" PDMESH_MODEL_DIR="$WORK/models"
# Nothing set, as a newcomer types it: the compose file's one-shot service generates the mesh
# secret every container shares (checked below).
unset PDMESH_MESH_SECRET
mkdir -p "$PDMESH_MODEL_DIR"
cat >"$WORK/override.yml" <<YAML
services:
  jaeger:
    image: $IMAGE
    entrypoint: ["pdmesh-otlp-sink"]
    healthcheck:
      test: ["CMD", "pdmesh", "healthcheck", "http://127.0.0.1:16686/health"]
      interval: 1s
      retries: 30
YAML
# Default services only: the metrics profile (Prometheus, Grafana) needs images this test cannot
# pull, so a COMPOSE_PROFILES from the environment must not reach compose here.
unset COMPOSE_PROFILES
compose() { "${COMPOSE[@]}" -p "$PROJECT" -f deploy/docker-compose.yml -f "$WORK/override.yml" "$@"; }
cleanup() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "compose-test: FAILED; container states and logs:"
    compose ps || true
    compose logs --tail=30 || true
  fi
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT
compose up -d --no-build

# ---- 4. a request through the published port
base="http://127.0.0.1:$PDMESH_HTTP_PORT"
for i in $(seq 1 180); do
  curl -fsS "$base/health" >/dev/null 2>&1 && break
  [[ $i -eq 180 ]] && { echo "compose-test: router not healthy after 180 s"; exit 1; }
  sleep 1
done
trace_id="$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
answer="$(curl -fsS "$base/v1/completions" -H 'content-type: application/json' \
  -H "traceparent: 00-$trace_id-00f067aa0ba902b7-01" \
  -d '{"prompt": "compose test", "max_tokens": 8, "temperature": 0}')"
echo "$answer" | python3 -c 'import json,sys; v=json.load(sys.stdin); assert v["choices"][0]["finish_reason"] in ("length","stop"), v'
echo "compose-test: request through :$PDMESH_HTTP_PORT answered"

# the generated mesh secret (P and D authenticated with it above): owner-only, the services' user's
mode="$(compose exec -T p-worker-0 stat -c '%a %u %s' /var/lib/pdmesh/secret/mesh-secret)"
[[ "$mode" == "600 10001 64" ]] || { echo "compose-test: mesh secret file is '$mode', want '600 10001 64'"; exit 1; }
echo "compose-test: generated mesh secret is mode 600, uid 10001, 64 hex digits"

# ---- 5. its spans reached the OTLP receiver container: every service of both nodes
want="pdmesh-router pdmesh-frontend pdmesh-dp-lb pdmesh-engine-core pdmesh-connector-scheduler pdmesh-connector-worker"
for i in $(seq 1 60); do
  if curl -fsS "http://127.0.0.1:$JAEGER_UI_PORT/api/spans?trace_id=$trace_id" >"$WORK/spans.json" 2>/dev/null \
     && python3 - "$WORK/spans.json" $want <<'PY'
import json, sys
spans = json.load(open(sys.argv[1]))
have = {(s["service"], s["resource"].get("pdmesh.node", "")) for s in spans}
want = {("pdmesh-router", "router")} | {(w, n) for w in sys.argv[2:] if w != "pdmesh-router" for n in ("prefill", "decode")}
reads = [s for s in spans if s["name"] == "kv.read" and int(s["attributes"].get("kv.bytes", 0)) > 0]
missing = sorted(want - have)
if missing or not reads:
    sys.exit(1)
print(f"compose-test: {len(spans)} spans of trace from {len(have)} service instances; kv.read moved {reads[0]['attributes']['kv.bytes']} bytes")
PY
  then break; fi
  [[ $i -eq 60 ]] && { echo "compose-test: spans incomplete after 60 s:"; python3 -c "import json,sys; print(sorted({(s['service'], s['resource'].get('pdmesh.node','')) for s in json.load(open(sys.argv[1]))}))" "$WORK/spans.json"; exit 1; }
  sleep 1
done

# ---- 6. down, and nothing left behind
compose down -v --remove-orphans
left="$(docker ps -a -q --filter "label=com.docker.compose.project=$PROJECT")"
[[ -z "$left" ]] || { echo "compose-test: containers left after down: $left"; exit 1; }
trap - EXIT
rm -rf "$WORK"
echo "compose-test: OK in $(( $(date +%s) - started )) s"
