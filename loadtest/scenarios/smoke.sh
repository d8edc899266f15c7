#!/usr/bin/env bash
# Smoke scenario (under 2 minutes on 2 cores): a synthetic P/D mesh takes a short steady load
# (closed loop, then Poisson arrivals), clients that disconnect mid-stream, and a burst of
# prompts D refuses (longer than D's max_model_len, so P has prefilled and holds them: rule
# R1); afterwards the mesh still serves, P and D hold and use no blocks, and no child died.
SCENARIO=smoke
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13000}"
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

log "rejection burst: 32 prompts of ~2400 tokens, over D's max_model_len (1024)"
load rejections --concurrency 16 --requests 32 --input-len 400 --output-len 16
check_report '^http_400$'
python3 - "$LAST_REPORT" <<'PY' || fail "the rejection burst was not refused"
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
sys.exit(0 if s["errors_by_kind"].get("http_400", 0) == s["requests_sent"] else 1)
PY

log "after the burst the mesh still serves"
load after --concurrency 4 --requests 32 --output-len 16
check_report '^$' 1.0

check_idle 20
finish
