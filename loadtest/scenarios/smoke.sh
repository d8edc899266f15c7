#!/usr/bin/env bash
# Smoke scenario (under 2 minutes on 2 cores): a synthetic P/D mesh takes a short steady load
# (closed loop, then Poisson arrivals), clients that disconnect mid-stream, and a burst of
# prompts D refuses (longer than D's max_model_len, so P has prefilled and holds them: rule
# R1); afterwards the mesh still serves, P and D hold and use no blocks, and no child died.
#
# SMOKE_BREAK=<figure> breaks one lifecycle figure on purpose and runs only what shows it; the
# scenario must then exit 1 (`loadtest/scenarios/selfcheck.sh` runs every one and fails if
# any passes):
#   stranded  D's rejection notices off (`rejection_notices = false`): P frees the requests D
#             refused after P answered (the non-streaming burst) only at its 2 s lease
#             deadline, stranded block-seconds while D is alive
#   held      the router's give-ups off (`router.give_up_notices = false`) and a fixed 480 s
#             hold: the streams D refused while P still prefilled (parallel dispatch, D66) leave
#             P holding blocks at the end
#   hang      D's reads delayed 20 s (`delay_transfer_ms`), clients give up after 3 s: requests
#             that hang (error kind `timeout`)
#   death     one of D's engine-cores killed under `pdmesh up --no-restart`: a death nobody
#             planned, left unrecovered
SCENARIO=smoke
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13000}"

# rejection_burst: D refuses what P prefilled (rule R1) on both of the router's paths —
# streams, whose decode leg D refuses while P still prefills (parallel dispatch, D66: the
# router hands P's blocks back), then non-streaming requests, which reach D with P's params
# (D tells P: the rejection notice).
rejection_burst() {
  local mode
  for mode in stream no-stream; do
    log "rejection burst ($mode): 32 prompts of ~2400 tokens, over D's max_model_len (1024)"
    # shellcheck disable=SC2046
    load "rejections-$mode" --concurrency 16 --requests 32 --input-len 400 --output-len 16 \
      $([[ $mode == no-stream ]] && echo --no-stream)
    # D refuses what P prefilled (400, rule R1); P may refuse some first with 503 + Retry-After
    # when holds would take more than engine.max_held_fraction of its pool (overload control).
    check_report '^http_(400|503)$'
    python3 - "$LAST_REPORT" <<'PY' || fail "the rejection burst ($mode) was not refused"
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
e = s["errors_by_kind"]
sys.exit(0 if e.get("http_400", 0) > 0 and e.get("http_400", 0) + e.get("http_503", 0) == s["requests_sent"] else 1)
PY
  done
}

if [[ -n "${SMOKE_BREAK:-}" ]]; then
  SCENARIO=smoke-break-$SMOKE_BREAK
  log "breaking a lifecycle figure on purpose: $SMOKE_BREAK (this run must fail)"
  case "$SMOKE_BREAK" in
    stranded)
      COST_US=20 LEASE_S=2 P_BLOCKS=8192 D_MAX_LEN=1024 NOTICES=false start_mesh "$SCENARIO"
      rejection_burst
      ;;
    held)
      COST_US=20 HOLD_MODE=fixed HOLD_S=480 P_BLOCKS=8192 D_MAX_LEN=1024 ROUTER_EXTRA="give_up_notices = false" start_mesh "$SCENARIO"
      rejection_burst
      ;;
    hang)
      COST_US=20 D_FAULT=delay_transfer_ms=20000 LEASE_S=30 start_mesh "$SCENARIO"
      load hang --concurrency 4 --requests 4 --output-len 16 --request-timeout-s 3
      check_report
      ;;
    death)
      COST_US=20 D_RANKS=2 UP_ARGS=--no-restart start_mesh "$SCENARIO"
      pid=$(python3 -c 'import json, sys; print(next(p["pid"] for p in json.load(open(sys.argv[1]))["processes"] if p["node"] == "d" and p["service"] == "engine-core" and p["rank"] == 1))' "$RUN_DIR/mesh.json")
      kill -KILL "$pid"
      load after-death --concurrency 4 --requests 32 --output-len 16
      check_report '^(http_5[0-9][0-9]|error_event)$'
      # `pdmesh up` notices the death within 100 ms; give it a moment to say so.
      for _ in $(seq 1 50); do grep -q "died" "$RUN_DIR/up.log" && break; sleep 0.1; done
      ;;
    *)
      echo "smoke: unknown SMOKE_BREAK=$SMOKE_BREAK (stranded, held, hang, death)" >&2
      exit 2
      ;;
  esac
  check_idle "${IDLE_WAIT_S:-5}"
  finish
fi

COST_US=20 LEASE_S=3 D_MAX_LEN=1024 start_mesh smoke

log "steady state: 8 clients, 200 requests, 16-48 output tokens"
load steady --concurrency 8 --requests 200 --warmup 8 --output-len 16-48 --slo-ttft-ms 200 --slo-tpot-ms 20
check_report

log "open loop: Poisson 60 req/s for 8 s, random lengths"
load poisson --rate 60 --duration 8 --input-len 8-64 --output-len 8-64 --slo-ttft-ms 200 --slo-tpot-ms 20
check_report '^$' 1.0

log "client disconnects: half of 60 streams dropped after 2 chunks"
load disconnects --concurrency 8 --requests 60 --output-len 64 --disconnect-fraction 0.5 --disconnect-after 2
check_report

rejection_burst

log "after the burst the mesh still serves"
load after --concurrency 4 --requests 32 --output-len 16
check_report '^$' 1.0

check_idle 20
finish
