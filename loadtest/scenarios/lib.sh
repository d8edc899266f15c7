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
  D_ENGINE_METRICS=()
  for ((r = 0; r < ${D_RANKS:-1}; r++)); do
    D_ENGINE_METRICS+=("http://127.0.0.1:$((BASE_PORT + 400 + 110 + 3 * r))/metrics")
  done
  if (( BASE_PORT + 600 >= 32768 || SIDE_PORT + 10 >= 32768 )); then
    echo "scenario: port $http puts ports in the ephemeral range" >&2
    exit 2
  fi
}

# write_topology FILE: a P/D mesh on the synthetic executor. Knobs (environment):
#   COST_US (per-token cost), P_BLOCKS, D_BLOCKS, P_MAX_LEN, D_MAX_LEN, D_RANKS, LEASE_S,
#   POLICY (kv_load_failure_policy of D), P_FAULT / D_FAULT (fault_injection per node).
write_topology() {
  cat >"$1" <<EOF
run_dir = "$RUN_DIR"

[[nodes]]
name = "router"
role = "router"
http_port = $HTTP_PORT
base_port = $BASE_PORT
router = { prefill = ["$P_URL"], decode = ["$D_URL"] }

[[nodes]]
name = "p"
role = "prefill"
http_port = $((HTTP_PORT + 1))
base_port = $((BASE_PORT + 200))
model = { kind = "synthetic", name = "pdmesh-synthetic", per_token_cost_us = ${COST_US:-20} }
engine = { block_size = 16, num_blocks = ${P_BLOCKS:-4096}, max_model_len = ${P_MAX_LEN:-8192}, max_num_seqs = 128 }
kv_transfer = { kv_role = "kv_producer", side_channel_port = $SIDE_PORT, data_port = $((SIDE_PORT + 2)), hold_mode = "lease", kv_lease_duration_s = ${LEASE_S:-5}, fault_injection = "${P_FAULT:-}" }

[[nodes]]
name = "d"
role = "decode"
http_port = $((HTTP_PORT + 2))
base_port = $((BASE_PORT + 400))
dp_size = ${D_RANKS:-1}
model = { kind = "synthetic", name = "pdmesh-synthetic", per_token_cost_us = ${COST_US:-20} }
engine = { block_size = 16, num_blocks = ${D_BLOCKS:-4096}, max_model_len = ${D_MAX_LEN:-2048}, max_num_seqs = 128 }
kv_transfer = { kv_role = "kv_consumer", side_channel_port = $((SIDE_PORT + 5)), data_port = $((SIDE_PORT + 7)), kv_load_failure_policy = "${POLICY:-fail}", fault_injection = "${D_FAULT:-}" }
EOF
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

# start_mesh NAME: writes the topology under a fresh run dir and starts `pdmesh up`, its
# stderr in <run_dir>/up.log (where a dying child is reported).
start_mesh() {
  RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-scenario-$1.XXXXXX")"
  write_topology "$RUN_DIR/topology.toml"
  RUST_LOG="${RUST_LOG:-warn}" PDMESH_RUN_DIR="$RUN_DIR" "$PDMESH" up --topology "$RUN_DIR/topology.toml" \
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

# load NAME ARGS...: pdmesh-load run against the router, scraping P's and D's frontends and
# engines; the report goes to $RESULTS_DIR/$SCENARIO/NAME/.
load() {
  local name=$1; shift
  local scrape=(--scrape "$P_URL/metrics" --scrape "$D_URL/metrics" --scrape "$P_ENGINE_METRICS")
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

# metric URL NAME: the sum of a metric's samples on a Prometheus page (all labels).
metric() {
  curl -fsS "$1" 2>/dev/null | python3 -c '
import sys
name = sys.argv[1]; total = 0.0; found = False
for line in sys.stdin:
    if line.startswith("#"): continue
    series, _, value = line.rstrip().rpartition(" ")
    if series.split("{")[0] == name:
        total += float(value); found = True
print(total if found else "missing")' "$2"
}

# check_idle SECONDS: P and D end holding and using no blocks (per /debug/kv and every
# engine's metrics) within SECONDS (P may wait for a lease deadline), and no child died.
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
      [[ "$v" == "0.0" ]] || fail "$u: $m = $v at the end"
    done
  done
  if grep -q "child process died" "$RUN_DIR/up.log"; then
    fail "a child process died:"
    grep "child process died" "$RUN_DIR/up.log" | head -5 >&2
  fi
  log "lifecycle: P held/used $kv_p, D held/used $kv_d"
}

finish() {
  stop_mesh
  if ((FAILURES > 0)); then
    log "$FAILURES check(s) failed (run dir kept: $RUN_DIR)"
    exit 1
  fi
  log "passed in ${SECONDS}s; reports under $RESULTS_DIR/$SCENARIO/"
}
