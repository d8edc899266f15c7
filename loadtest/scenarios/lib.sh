# Shared helpers of the load-test scenarios (sourced, not run).
#
# A scenario starts a synthetic-executor P/D mesh (router + prefill + decode) with
# `pdmesh up`, drives it with `pdmesh-load run`, and ends with lifecycle checks: P and D hold
# and use zero KV blocks, no child process died, and every request was answered or cleanly
# refused. Any broken figure makes the scenario exit non-zero.
#
# Environment:
#   PDMESH_BIN_DIR          where `pdmesh` and `pdmesh-load` are (default: target/release)
#   PDMESH_SCENARIO_PORT    first HTTP port (router; P is +1, D is +2); every port stays below
#                           32768, Linux's ephemeral range, so a client socket never takes one
#   PDMESH_RESULTS_DIR      where reports go (default: results/)
#   MODEL                   `synthetic` (default) or `gguf`: the real model ($PDMESH_MODEL_PATH,
#                           else the fetch cache), for real-model results
#   ROUTER_EXTRA            more keys for the router's table, e.g.
#                           `first_token_from_prefill = false` (D63's before/after)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN_DIR="${PDMESH_BIN_DIR:-$ROOT/target/release}"
RESULTS_DIR="${PDMESH_RESULTS_DIR:-$ROOT/results}"
PDMESH="$BIN_DIR/pdmesh"
LOAD="$BIN_DIR/pdmesh-load"
for b in "$PDMESH" "$LOAD"; do
  [[ -x "$b" ]] || { echo "scenario: $b missing; build with cargo build --release -p pdmesh -p pdmesh-loadtest" >&2; exit 2; }
done
for tool in python3 curl; do
  command -v "$tool" >/dev/null || { echo "scenario: $tool is required for the checks" >&2; exit 2; }
done

FAILURES=0
UP_PID=""
RUN_DIR=""

log() { echo "[$(date -u +%H:%M:%S)] ${SCENARIO:-scenario}: $*" >&2; }
fail() { log "FAIL: $*"; FAILURES=$((FAILURES + 1)); }

# mesh_ports HTTP: sets ROUTER/P_URL/D_URL and the engine metrics URLs of each rank.
# Layout, for HTTP in 13000..13120: router HTTP, P HTTP+1, D HTTP+2; base ports
# 20000 + (HTTP-13000)*100 + 0/200/400 (engine-core rank r metrics at base + 110 + 3r), so
# scenarios 10 HTTP ports apart never share a port; side channels HTTP+5000 + 0..9.
mesh_ports() {
  local http=$1
  HTTP_PORT=$http
  if (( http < 13000 || http > 13120 )); then
    echo "scenario: HTTP port $http outside 13000..13120" >&2
    exit 2
  fi
  BASE_PORT=$(( 20000 + (http - 13000) * 100 ))
  SIDE_PORT=$(( http + 5000 ))
  ROUTER="http://127.0.0.1:$http"
  P_URL="http://127.0.0.1:$((http + 1))"
  D_URL="http://127.0.0.1:$((http + 2))"
  P_ENGINE_METRICS="http://127.0.0.1:$((BASE_PORT + 200 + 110))/metrics"
  P_WORKER_METRICS="http://127.0.0.1:$((BASE_PORT + 200 + 112))/metrics"
  D_ENGINE_METRICS=()
  for ((r = 0; r < ${D_RANKS:-1}; r++)); do
    D_ENGINE_METRICS+=("http://127.0.0.1:$((BASE_PORT + 400 + 110 + 3 * r))/metrics")
  done
  if (( BASE_PORT + 600 >= 32768 || SIDE_PORT + 10 >= 32768 )); then
    echo "scenario: port $http puts ports in the ephemeral range" >&2
    exit 2
  fi
}

# write_topology FILE: a P/D mesh on the synthetic executor (or the real model, MODEL=gguf).
# Knobs (environment): COST_US (synthetic per-token cost), P_BLOCKS, D_BLOCKS, P_MAX_LEN,
# D_MAX_LEN, D_RANKS, LEASE_S, HOLD_MODE (lease | fixed: P then holds for HOLD_S, default 480),
# NOTICES (rejection_notices of D: true | false), POLICY (kv_load_failure_policy of D),
# P_FAULT / D_FAULT (fault_injection per node), P_THREADS / D_THREADS (model.threads, real model),
# CPU_NICE (model.cpu_nice of every real-model node, the colocated ones too; default: the
# config's, D71), LIMITS (keys of every node's `limits` table, e.g. `request_deadline_s = 60`).
# The topology is printed by `pdmesh-load topology pd`, from the typed builders the tests use
# (pdmesh-test-support), so it cannot drift from the config schema.
# model_args: the `pdmesh-load topology` flags of MODEL (and COST_US, CPU_NICE).
model_args() {
  if [[ "${MODEL:-synthetic}" == gguf ]]; then
    echo "--model gguf${CPU_NICE:+ --cpu-nice $CPU_NICE}"
  else
    echo "--model synthetic --model-name pdmesh-synthetic --cost-us ${COST_US:-20}"
  fi
}

write_topology() {
  # shellcheck disable=SC2046 # model_args is a word list
  "$LOAD" topology pd --run-dir "$RUN_DIR" --http-port "$HTTP_PORT" --base-port "$BASE_PORT" \
    --side-port "$SIDE_PORT" $(model_args) ${P_THREADS:+--p-threads "$P_THREADS"} \
    ${D_THREADS:+--d-threads "$D_THREADS"} ${P_BLOCKS:+--p-blocks "$P_BLOCKS"} ${D_BLOCKS:+--d-blocks "$D_BLOCKS"} \
    --p-max-len "${P_MAX_LEN:-8192}" --d-max-len "${D_MAX_LEN:-2048}" --d-ranks "${D_RANKS:-1}" \
    --hold-mode "${HOLD_MODE:-lease}" --lease-s "${LEASE_S:-5}" --hold-s "${HOLD_S:-480}" \
    --notices "${NOTICES:-true}" --policy "${POLICY:-fail}" --p-fault "${P_FAULT:-}" --d-fault "${D_FAULT:-}" \
    --router-extra "${ROUTER_EXTRA:-}" --limits "${LIMITS:-}" >"$1"
}

wait_engines() { # URL SECONDS: until /debug/engines lists an engine
  local deadline=$((SECONDS + $2))
  while ((SECONDS < deadline)); do
    if curl -fsS "$1/debug/engines" 2>/dev/null | python3 -c 'import sys,json; sys.exit(0 if json.load(sys.stdin).get("engines") else 1)' 2>/dev/null; then
      return 0
    fi
    sleep 0.2
  done
  return 1
}

# start_mesh NAME: writes the topology under a fresh run dir and starts `pdmesh up` (with
# UP_ARGS, e.g. --no-restart), its stderr in <run_dir>/up.log (where a dying child is reported).
start_mesh() {
  RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-scenario-$1.XXXXXX")"
  write_topology "$RUN_DIR/topology.toml"
  # shellcheck disable=SC2086 # UP_ARGS is a word list
  RUST_LOG="${RUST_LOG:-warn}" PDMESH_RUN_DIR="$RUN_DIR" "$PDMESH" up --topology "$RUN_DIR/topology.toml" ${UP_ARGS:-} \
    >"$RUN_DIR/up.out" 2>"$RUN_DIR/up.log" &
  UP_PID=$!
  trap stop_mesh EXIT
  if ! wait_engines "$P_URL" 60 || ! wait_engines "$D_URL" 60; then
    log "mesh did not come up; up.log:"
    tail -20 "$RUN_DIR/up.log" >&2 || true
    exit 1
  fi
  # The router answers once P and D do; one probe request makes sure.
  local deadline=$((SECONDS + 30))
  until curl -fsS "$ROUTER/v1/models" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || { log "router not ready"; exit 1; }
    sleep 0.2
  done
  log "mesh up (run dir $RUN_DIR, pid $UP_PID)"
}

stop_mesh() {
  if [[ -n "$UP_PID" ]] && kill -0 "$UP_PID" 2>/dev/null; then
    kill -TERM "$UP_PID" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$UP_PID" 2>/dev/null && kill -KILL "$UP_PID" 2>/dev/null || true
    wait "$UP_PID" 2>/dev/null || true
  fi
  UP_PID=""
  if [[ -n "$RUN_DIR" && "${PDMESH_KEEP_RUN_DIR:-0}" != "1" && $FAILURES -eq 0 ]]; then
    rm -rf "$RUN_DIR"
  fi
}

# start_colocated: a colocated node next to the P/D mesh's ports (HTTP+3, base ports above the
# mesh's), started in the background: sets COLO_URL, COLO_DIR and COLO_PID. The caller waits for
# it (wait_engines "$COLO_URL") and stops it with stop_colocated.
start_colocated() {
  COLO_URL="http://127.0.0.1:$((HTTP_PORT + 3))"
  COLO_DIR="$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-scenario-colocated.XXXXXX")"
  # shellcheck disable=SC2046 # model_args is a word list
  "$LOAD" topology colocated --run-dir "$COLO_DIR" --http-port $((HTTP_PORT + 3)) --base-port $((BASE_PORT + 600)) \
    $(model_args) >"$COLO_DIR/topology.toml"
  RUST_LOG="${RUST_LOG:-warn}" PDMESH_RUN_DIR="$COLO_DIR" "$PDMESH" up --topology "$COLO_DIR/topology.toml" \
    >"$COLO_DIR/up.out" 2>"$COLO_DIR/up.log" &
  COLO_PID=$!
}

stop_colocated() {
  kill -TERM "$COLO_PID" 2>/dev/null || true
  wait "$COLO_PID" 2>/dev/null || true
  rm -rf "$COLO_DIR"
}

# load NAME ARGS...: pdmesh-load run against the router, scraping P's and D's frontends and
# engines; the report goes to $RESULTS_DIR/$SCENARIO/NAME/.
load() {
  local name=$1; shift
  local scrape=(--scrape "$P_URL/metrics" --scrape "$D_URL/metrics" --scrape "$P_ENGINE_METRICS" --scrape "$P_WORKER_METRICS")
  for u in "${D_ENGINE_METRICS[@]}"; do scrape+=(--scrape "$u"); done
  LAST_REPORT="$RESULTS_DIR/$SCENARIO/$name/report.json"
  mkdir -p "$RESULTS_DIR/$SCENARIO"
  "$LOAD" run --url "$ROUTER" "${scrape[@]}" --out-dir "$RESULTS_DIR/$SCENARIO/$name" "$@" 2>"$RESULTS_DIR/$SCENARIO/$name.log" \
    || { fail "pdmesh-load $name exited non-zero"; cat "$RESULTS_DIR/$SCENARIO/$name.log" >&2; return 0; }
  python3 - "$LAST_REPORT" <<'EOF' >&2
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
def q(x, k): return "–" if x[k] is None else f"{x[k]:.2f}"
print(f"  {s['requests_sent']} sent, {s['succeeded']} ok, {s['disconnected']} disconnected, "
      f"{s['failed']} failed {s['errors_by_kind']}; {s['request_throughput_rps']:.1f} req/s, "
      f"{s['output_token_throughput_tps']:.0f} tok/s; TTFT p50 {q(s['ttft_ms'], 'p50_ms')} ms, "
      f"p99 {q(s['ttft_ms'], 'p99_ms')} ms; TPOT p50 {q(s['tpot_ms'], 'p50_ms')} ms")
EOF
}

# check_report [ALLOWED_ERRORS_REGEX] [MIN_SUCCESS_FRACTION]: every request of the last run
# was answered, disconnected on purpose, or refused with an error kind matching the regex
# (default: none allowed); transport errors, timeouts and cut streams are never allowed.
check_report() {
  local allowed="${1:-^$}" min_ok="${2:-0}"
  python3 - "$LAST_REPORT" "$allowed" "$min_ok" <<'EOF' || fail "report check: $LAST_REPORT"
import json, re, sys
r = json.load(open(sys.argv[1])); s = r["summary"]
allowed = re.compile(sys.argv[2]); min_ok = float(sys.argv[3])
bad = {k: v for k, v in s["errors_by_kind"].items() if not allowed.search(k)}
accounted = s["succeeded"] + s["disconnected"] + s["failed"]
problems = []
if bad: problems.append(f"unexpected errors {bad}")
if accounted != s["requests_sent"]: problems.append(f"{s['requests_sent']} sent but {accounted} accounted for")
if s["requests_sent"] == 0: problems.append("nothing sent")
if s["requests_sent"] and s["succeeded"] / s["requests_sent"] < min_ok:
    problems.append(f"only {s['succeeded']} of {s['requests_sent']} succeeded (want >= {min_ok:.0%})")
if problems:
    print("  " + "; ".join(problems), file=sys.stderr); sys.exit(1)
EOF
}

# metric URL NAME [LABEL]: the sum of a metric's samples on a Prometheus page (all labels, or
# only the samples whose labels contain LABEL, e.g. released_by="expired"); "missing" when the
# page or the metric is absent.
metric() {
  { curl -fsS "$1" 2>/dev/null || true; } | python3 -c '
import sys
name, label = sys.argv[1], sys.argv[2]; total = 0.0; found = False
for line in sys.stdin:
    if line.startswith("#"): continue
    series, _, value = line.rstrip().rpartition(" ")
    if series.split("{")[0] == name and label in series:
        total += float(value); found = True
print(total if found else "missing")' "$2" "${3:-}"
}

# stranded: block-seconds P held for requests nobody released, freed only by the hold deadline
# (P's worker, `pdmesh_worker_kv_held_block_seconds_total{released_by="expired"}`; 0 when no
# hold has expired yet). While D is alive this must stay 0: D tells P whenever it gives up.
stranded() {
  local v
  v=$(metric "$P_WORKER_METRICS" pdmesh_worker_kv_held_block_seconds_total 'released_by="expired"')
  if [[ "$v" == missing ]]; then
    # The counter appears with its first expiry; the page itself must answer.
    curl -fsS "$P_WORKER_METRICS" >/dev/null 2>&1 && v=0.0
  fi
  echo "$v"
}

# check_stranded: no block-seconds stranded beyond STRANDED_BASE (default 0: D was alive the
# whole run; the kill scenario excuses what expired while D's processes were down).
check_stranded() {
  local v
  v=$(stranded)
  python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)' "$v" "${STRANDED_BASE:-0}" 2>/dev/null \
    || fail "stranded block-seconds where D was alive: $v (excused: ${STRANDED_BASE:-0})"
}

# check_deaths: every child `pdmesh up` reported dead is one the scenario killed on purpose
# (labels in KILLED, e.g. "d.engine-core.0"), and every process of the mesh is alive again
# (mesh.json), so no death is left unrecovered.
check_deaths() {
  local died label
  died=$(grep -o 'pdmesh up: [^ ]* (pid [0-9]*) died' "$RUN_DIR/up.log" 2>/dev/null | awk '{print $3}' | sort -u || true)
  for label in $died; do
    if [[ " ${KILLED:-} " != *" $label "* ]]; then
      fail "child process died: $label (not killed by the scenario)"
      grep "pdmesh up: $label " "$RUN_DIR/up.log" | head -3 >&2
    fi
  done
  python3 - "$RUN_DIR/mesh.json" <<'PY' || fail "a death was left unrecovered"
import json, sys
procs = json.load(open(sys.argv[1]))["processes"]
down = [f'{p["node"]}.{p["service"]}.{p["rank"]}' for p in procs if not p["alive"]]
if down:
    print(f"  not running at the end: {down}", file=sys.stderr); sys.exit(1)
PY
}

# check_idle SECONDS: P and D end holding and using no blocks (per /debug/kv and every
# engine's metrics) within SECONDS (P may wait for a lease deadline), no hold was left to its
# deadline while D was alive, and no child died (or every death was planned and recovered).
check_idle() {
  local deadline=$((SECONDS + $1)) kv_p kv_d
  while :; do
    kv_p=$(curl -fsS "$P_URL/debug/kv" 2>/dev/null | python3 -c 'import sys,json; v=json.load(sys.stdin); print(v["held_blocks"], v["used_blocks"])' 2>/dev/null || echo "? ?")
    kv_d=$(curl -fsS "$D_URL/debug/kv" 2>/dev/null | python3 -c 'import sys,json; v=json.load(sys.stdin); print(v["held_blocks"], v["used_blocks"])' 2>/dev/null || echo "? ?")
    [[ "$kv_p" == "0 0" && "$kv_d" == "0 0" ]] && break
    if ((SECONDS >= deadline)); then
      fail "blocks not released after ${1}s: P held/used $kv_p, D held/used $kv_d"
      break
    fi
    sleep 0.5
  done
  local u v
  for u in "$P_ENGINE_METRICS" "${D_ENGINE_METRICS[@]}"; do
    for m in pdmesh_engine_kv_held_blocks pdmesh_engine_kv_used_blocks; do
      v=$(metric "$u" "$m")
      # A gauge appears once first set: absent from a page that answers means never used.
      [[ "$v" == missing ]] && curl -fsS "$u" >/dev/null 2>&1 && v=0.0
      [[ "$v" == "0.0" ]] || fail "$u: $m = $v at the end"
    done
  done
  check_stranded
  check_deaths
  log "lifecycle: P held/used $kv_p, D held/used $kv_d; stranded block-seconds $(stranded)"
}

finish() {
  stop_mesh
  if ((FAILURES > 0)); then
    log "$FAILURES check(s) failed (run dir kept: $RUN_DIR)"
    exit 1
  fi
  log "passed in ${SECONDS}s; reports under $RESULTS_DIR/$SCENARIO/"
}
