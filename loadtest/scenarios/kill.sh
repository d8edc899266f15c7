#!/usr/bin/env bash
# Kill scenario: for each target (KILL_CASES), a P/D mesh (D with 2 ranks) takes open-loop
# streaming load through the router; once it is under way, the target is killed with SIGKILL —
# one process of P or D (`node:service:rank`) or every process of a node (`node:node`) — and
# `pdmesh up` restarts it. Afterwards:
#   - every request of the run was answered, or refused cleanly (an OpenAI error body, or an
#     `error` event ending the stream): no hang (timeout), no cut stream, no reset;
#   - every death is one the scenario caused, and every process runs again (none left
#     unrecovered), and the mesh serves every request of a fresh load;
#   - P and D end holding and using no blocks;
#   - no block-seconds were stranded (freed only by P's hold deadline) while D was alive: for a
#     kill on P that is the whole run; for a kill on D, what expired while D's process was down
#     is reported, not excused afterwards.
# The per-case figures go to results/kill/kill.md.
#
# Knobs: KILL_CASES, DURATION (seconds of load per case, default 20), RATE (Poisson req/s, 8),
# COST_US (synthetic per-token cost, default 1000), MODEL, UP_ARGS (`--no-restart` shows the
# check failing: the killed process is then left dead).
SCENARIO=kill
source "$(dirname "$0")/lib.sh"
port=${PDMESH_SCENARIO_PORT:-13060}
export D_RANKS=2
CASES=${KILL_CASES:-p:connector-worker:0 p:engine-core:0 d:engine-core:0 d:connector-worker:1 p:node d:node}

# targets TARGET: "pid label" per process of the target, from mesh.json.
targets() {
  python3 - "$RUN_DIR/mesh.json" "$1" <<'PY'
import json, sys
procs = json.load(open(sys.argv[1]))["processes"]
node, service, *rank = sys.argv[2].split(":")
per_rank = ("engine-core", "connector-scheduler", "connector-worker")
for p in procs:
    if p["node"] != node or (service != "node" and (p["service"] != service or [str(p["rank"])] != rank)):
        continue
    label = f'{p["node"]}.{p["service"]}' + (f'.{p["rank"]}' if p["service"] in per_rank else "")
    print(p["pid"], label)
PY
}

# until_loaded SECONDS: D's frontend has finished some requests and has several in flight.
until_loaded() {
  local deadline=$((SECONDS + $1)) done inflight
  while ((SECONDS < deadline)); do
    done=$(metric "$D_URL/metrics" pdmesh_frontend_request_finish_total)
    inflight=$(metric "$D_URL/metrics" pdmesh_frontend_requests_in_flight)
    if [[ $done != missing && $inflight != missing ]] \
      && python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) >= 16 and float(sys.argv[2]) >= 2 else 1)' "$done" "$inflight"; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

# recovered PIDS...: every killed pid was replaced by a live process in mesh.json, P's and D's
# frontends see all their engine ranks, and a request through the router succeeds.
recovered() {
  python3 - "$RUN_DIR/mesh.json" "$@" <<'PY' || return 1
import json, sys
procs = json.load(open(sys.argv[1]))["processes"]
killed = {int(p) for p in sys.argv[2:]}
sys.exit(0 if all(p["alive"] and p["pid"] not in killed for p in procs) else 1)
PY
  local u
  for u in "$P_URL" "$D_URL"; do
    curl -fsS "$u/debug/engines" 2>/dev/null | python3 -c '
import sys, json
v = json.load(sys.stdin)
sys.exit(0 if v.get("engines") and not v.get("unreachable_ranks") else 1)' 2>/dev/null || return 1
  done
  curl -fsS -m 30 "$ROUTER/v1/completions" -H 'content-type: application/json' \
    -d '{"prompt": "are you back?", "max_tokens": 4}' >/dev/null 2>&1
}

# p_drained SECONDS: P holds no blocks (holds nobody will release go at P's lease deadline).
p_drained() {
  local deadline=$((SECONDS + $1))
  while ((SECONDS < deadline)); do
    [[ "$(metric "$P_ENGINE_METRICS" pdmesh_engine_kv_held_blocks)" == 0.0 ]] && return 0
    sleep 0.2
  done
  return 1
}

rows=("| target | sent | ok | clean refusals | other errors | recovery s | stranded block-s (D down) | after: sent / ok |"
      "|---|---|---|---|---|---|---|---|")
for target in $CASES; do
  mesh_ports "$port"
  name=${target//:/-}
  KILLED=""
  STRANDED_BASE=0
  log "case $target"
  COST_US=${COST_US:-1000} LEASE_S=${LEASE_S:-10} start_mesh "$name"

  # Open loop, so requests refused fast while the target is down do not multiply.
  load "$name" --rate "${RATE:-8}" --concurrency 32 --duration "${DURATION:-20}" --output-len 32-96 \
    --request-timeout-s 60 &
  load_pid=$!
  until_loaded 60 || fail "$target: the load never got under way"
  s0=$(stranded)
  [[ "$s0" == 0.0 ]] || fail "$target: $s0 block-seconds stranded before the kill"

  pids=()
  while read -r pid label; do
    pids+=("$pid")
    KILLED+="$label "
  done < <(targets "$target")
  ((${#pids[@]} > 0)) || { fail "$target: no such process"; kill "$load_pid" 2>/dev/null; wait "$load_pid" || true; stop_mesh; continue; }
  t_kill=$EPOCHREALTIME
  kill -KILL "${pids[@]}"
  log "  killed ${KILLED}(pids ${pids[*]})"
  deadline=$((SECONDS + 60)) recovery=""
  while ((SECONDS < deadline)); do
    if recovered "${pids[@]}"; then
      recovery=$(python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.1f}")' "$t_kill" "$EPOCHREALTIME")
      break
    fi
    sleep 0.2
  done
  [[ -n "$recovery" ]] || { fail "$target: not recovered within 60 s"; recovery="never"; }
  log "  recovered after ${recovery} s"

  wait "$load_pid" || true
  LAST_REPORT="$RESULTS_DIR/$SCENARIO/$name/report.json"
  during_report=$LAST_REPORT
  if [[ -f "$LAST_REPORT" ]]; then
    check_report '^(http_5[0-9][0-9]|error_event)$'
  else
    fail "$target: no report"
  fi

  # What P's hold deadline had to free: nothing while D was alive.
  p_drained 20 || fail "$target: P still holds blocks 20 s after the load"
  s1=$(stranded)
  if [[ $target == d:* ]]; then
    STRANDED_BASE=$s1
  elif [[ "$s1" != 0.0 ]]; then
    fail "$target: $s1 block-seconds stranded while D was alive"
  fi

  load "$name-after" --concurrency 4 --requests 40 --output-len 16 --request-timeout-s 60
  check_report '^$' 1.0
  after_report=$LAST_REPORT
  check_idle 20

  rows+=("$(python3 - "$target" "$during_report" "$after_report" "$recovery" "$s1" <<'PY'
import json, re, sys
target, during, after, recovery, stranded = sys.argv[1:]
def summary(path):
    try: return json.load(open(path))["summary"]
    except Exception: return None
d, a = summary(during), summary(after)
if d is None:
    print(f"| {target} | – | – | – | – | {recovery} | {stranded} | – |"); sys.exit()
clean = {k: v for k, v in d["errors_by_kind"].items() if re.fullmatch(r"http_5\d\d|error_event", k)}
other = {k: v for k, v in d["errors_by_kind"].items() if k not in clean}
fmt = lambda m: ", ".join(f"{k} {v}" for k, v in sorted(m.items())) or "0"
after = f'{a["requests_sent"]} / {a["succeeded"]}' if a else "–"
print(f'| {target} | {d["requests_sent"]} | {d["succeeded"]} | {fmt(clean)} | {fmt(other)} | {recovery} | {float(stranded):.1f} | {after} |')
PY
)")
  stop_mesh
done

mkdir -p "$RESULTS_DIR/$SCENARIO"
printf '%s\n' "${rows[@]}" | tee "$RESULTS_DIR/$SCENARIO/kill.md" >&2
finish
