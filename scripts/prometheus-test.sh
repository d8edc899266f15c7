#!/usr/bin/env bash
# Prometheus for real: Debian's `prometheus` scrapes a running mesh with deploy/prometheus.yml's
# scrape config, and its HTTP API must show every target up and a pdmesh series with the labels
# the Grafana dashboard filters on.
#
# The mesh is `pdmesh up` on the built-in topology (deploy/topology/default.toml, the real
# model): its services listen on the same ports as the compose file's containers, so the only
# change to deploy/prometheus.yml is each target's host (a container name there) becoming
# 127.0.0.1. Skips (exit 0, with the reason) when there is no `prometheus` binary; .ci/run
# installs Debian's package. Reuses the release binaries (PDMESH_BIN_DIR, default
# target/release).
set -euo pipefail
cd "$(dirname "$0")/.."
skip() { echo "prometheus-test: SKIPPED: $*"; exit 0; }
command -v prometheus >/dev/null || skip "no prometheus binary (apt-get install prometheus)"
BIN_DIR=${PDMESH_BIN_DIR:-${CARGO_TARGET_DIR:-target}/release}
[[ -x "$BIN_DIR/pdmesh" ]] || { echo "prometheus-test: $BIN_DIR/pdmesh missing (cargo build --release --workspace)"; exit 1; }
started=$(date +%s)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-prometheus.XXXXXX")
MODEL=${PDMESH_MODEL_PATH:-$(scripts/fetch-model.sh)}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PROM_PORT=$(free_port)
up_pid=""
prom_pid=""
cleanup() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "prometheus-test: FAILED; last lines of the logs:"
    tail -n 20 "$WORK/up.log" "$WORK/prometheus.log" 2>/dev/null || true
  fi
  [[ -n "$prom_pid" ]] && kill "$prom_pid" 2>/dev/null || true
  if [[ -n "$up_pid" ]]; then
    kill -INT "$up_pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$up_pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$up_pid" 2>/dev/null || true
  fi
  rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT

# ---- 1. the mesh
PDMESH_RUN_DIR="$WORK/run" "$BIN_DIR/pdmesh" up --model "$MODEL" >"$WORK/up.log" 2>&1 &
up_pid=$!
for i in $(seq 1 120); do
  curl -fsS http://127.0.0.1:8000/health >/dev/null 2>&1 && break
  kill -0 "$up_pid" 2>/dev/null || { echo "prometheus-test: pdmesh up exited"; exit 1; }
  [[ $i -eq 120 ]] && { echo "prometheus-test: router not healthy after 120 s"; exit 1; }
  sleep 1
done
curl -fsS http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}' >/dev/null

# ---- 2. Prometheus with deploy/prometheus.yml, targets on this host
sed -E 's/targets: \[[a-z0-9-]+:([0-9]+)\]/targets: ["127.0.0.1:\1"]/' deploy/prometheus.yml >"$WORK/prometheus.yml"
grep -q 'targets: \["127.0.0.1:8000"\]' "$WORK/prometheus.yml" || { echo "prometheus-test: could not rewrite the targets"; exit 1; }
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
prom_pid=$!

# ---- 3. every target up, and a series with the dashboard's labels
api="http://127.0.0.1:$PROM_PORT/api/v1"
for i in $(seq 1 60); do
  if curl -fsS "$api/targets" >"$WORK/targets.json" 2>/dev/null &&
     curl -fsS "$api/query" --data-urlencode 'query=pdmesh_frontend_http_requests_total{endpoint="/v1/completions"}' \
       >"$WORK/query.json" 2>/dev/null &&
     python3 - "$WORK/targets.json" "$WORK/query.json" <<'PY'
import json, sys
targets = json.load(open(sys.argv[1]))["data"]["activeTargets"]
series = json.load(open(sys.argv[2]))["data"]["result"]
up = [t for t in targets if t["health"] == "up"]
if len(targets) != 14 or len(up) != len(targets):
    sys.exit(1)
nodes = {s["metric"].get("node") for s in series}
if not {"router", "prefill", "decode"} <= nodes or any(s["metric"].get("service") != "frontend" for s in series):
    sys.exit(1)
print(f"prometheus-test: {len(up)}/{len(targets)} targets up; pdmesh_frontend_http_requests_total for nodes {sorted(nodes)}")
PY
  then break; fi
  kill -0 "$prom_pid" 2>/dev/null || { echo "prometheus-test: prometheus exited"; exit 1; }
  if [[ $i -eq 60 ]]; then
    echo "prometheus-test: after 60 s:"
    python3 -c "import json,sys; [print(' ', t['labels'].get('instance'), t['health'], t.get('lastError','')) for t in json.load(open(sys.argv[1]))['data']['activeTargets']]" "$WORK/targets.json" || true
    cat "$WORK/query.json" 2>/dev/null || true
    exit 1
  fi
  sleep 1
done
echo "prometheus-test: OK in $(( $(date +%s) - started )) s"
