#!/usr/bin/env bash
# Load-aware routing around a slowed decode node (D55), side by side with round robin.
#
# One mesh: 2 prefill and 2 decode nodes behind two routers over the same four nodes, one
# `policy = "least_loaded"` (router :HTTP) and one `policy = "round_robin"` (router :HTTP+5).
# The synthetic executor with a mostly per-step cost (per_step_cost_us = STEP_US, per token
# 100 us: a decode step costs about the same for 4 or 8 sequences, as on an accelerator).
# Two phases, each with its own `pdmesh up`: `healthy` (both D as configured) and `slowed`
# (decode-b's executor under `model.fault_injection = "step_delay_ms=DELAY_MS"`). In each
# phase both routers get the same closed-loop load in turn: CONCURRENCY streams of 64 tokens,
# REQUESTS requests. Prints p50/p99 ITL of every (phase, policy) and the slowed/healthy ratios.
#
#   STEP_US (8000), DELAY_MS (30), CONCURRENCY (8), REQUESTS (96)
SCENARIO=slow-decode
MODEL=synthetic
source "$(dirname "$0")/lib.sh"
HTTP=${PDMESH_SCENARIO_PORT:-13200}
STEP_US=${STEP_US:-8000}
DELAY_MS=${DELAY_MS:-30}
CONCURRENCY=${CONCURRENCY:-8}
REQUESTS=${REQUESTS:-96}
OUT="$RESULTS_DIR/$SCENARIO"
mkdir -p "$OUT"

topology() { # DIR FAULT
  local dir=$1 fault=$2 base=$((20000 + (HTTP - 13000) * 10))
  local model="model = { kind = \"synthetic\", per_step_cost_us = $STEP_US, per_token_cost_us = 100 }"
  local engine="engine = { block_size = 16, num_blocks = 1024, max_num_seqs = 64 }"
  local p="[\"http://127.0.0.1:$((HTTP + 1))\", \"http://127.0.0.1:$((HTTP + 2))\"]"
  local d="[\"http://127.0.0.1:$((HTTP + 3))\", \"http://127.0.0.1:$((HTTP + 4))\"]"
  node() { # NAME ROLE HTTP BASE KV_ROLE SIDE EXTRA
    cat <<N
[[nodes]]
name = "$1"
role = "$2"
http_port = $3
base_port = $4
${model%\}*}$7 }
$engine
kv_transfer = { kv_role = "$5", engine_id = "$1", backend = "tcp", side_channel_port = $6, data_port = $(($6 + 2)) }

N
  }
  {
    echo "run_dir = \"$dir\""
    printf '[[nodes]]\nname = "router-ll"\nrole = "router"\nhttp_port = %s\nbase_port = %s\nrouter = { prefill = %s, decode = %s, policy = "least_loaded" }\n\n' \
      "$HTTP" "$base" "$p" "$d"
    printf '[[nodes]]\nname = "router-rr"\nrole = "router"\nhttp_port = %s\nbase_port = %s\nrouter = { prefill = %s, decode = %s, policy = "round_robin" }\n\n' \
      "$((HTTP + 5))" "$((base + 20))" "$p" "$d"
    node prefill-a prefill $((HTTP + 1)) $((base + 200)) kv_producer $((HTTP + 5000)) ""
    node prefill-b prefill $((HTTP + 2)) $((base + 400)) kv_producer $((HTTP + 5010)) ""
    node decode-a decode $((HTTP + 3)) $((base + 600)) kv_consumer $((HTTP + 5020)) ""
    node decode-b decode $((HTTP + 4)) $((base + 800)) kv_consumer $((HTTP + 5030)) "$fault"
  } >"$dir/topology.toml"
}

for phase in healthy slowed; do
  dir="$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-slow-decode.XXXXXX")"
  fault=""
  [[ $phase == slowed ]] && fault=", fault_injection = \"step_delay_ms=$DELAY_MS\""
  topology "$dir" "$fault"
  RUST_LOG="${RUST_LOG:-warn}" PDMESH_RUN_DIR="$dir" "$PDMESH" up --topology "$dir/topology.toml" >"$dir/up.out" 2>"$dir/up.log" &
  up=$!
  for port in $((HTTP + 1)) $((HTTP + 2)) $((HTTP + 3)) $((HTTP + 4)); do
    wait_engines "http://127.0.0.1:$port" 90 || { log "node :$port did not come up"; tail -20 "$dir/up.log" >&2; kill "$up"; exit 1; }
  done
  for policy in ll rr; do
    port=$HTTP
    [[ $policy == rr ]] && port=$((HTTP + 5))
    log "$phase, $policy: $CONCURRENCY streams, $REQUESTS requests"
    "$LOAD" run --url "http://127.0.0.1:$port" --endpoint completions --concurrency "$CONCURRENCY" \
      --requests "$REQUESTS" --warmup "$CONCURRENCY" --output-len 64 --out-dir "$OUT/$phase-$policy" \
      2>"$OUT/$phase-$policy.log" || fail "pdmesh-load $phase $policy exited non-zero"
  done
  kill -TERM "$up"; wait "$up" || true
  rm -rf "$dir"
done

python3 - "$OUT" <<'PY' | tee "$OUT/summary.md" >&2
import json, sys
out = sys.argv[1]
r = {k: json.load(open(f"{out}/{k}/report.json"))["summary"] for k in
     ["healthy-ll", "healthy-rr", "slowed-ll", "slowed-rr"]}
for k, s in r.items():
    if s["failed"]:
        sys.exit(f"{k}: {s['failed']} failed requests")
print("| policy | healthy ITL p50 / p99 (ms) | decode-b slowed ITL p50 / p99 (ms) | p99 slowed ÷ healthy |")
print("|---|---|---|---|")
for pol, name in [("ll", "least_loaded"), ("rr", "round_robin")]:
    h, s = r[f"healthy-{pol}"]["itl_ms"], r[f"slowed-{pol}"]["itl_ms"]
    print(f"| {name} | {h['p50_ms']:.1f} / {h['p99_ms']:.1f} | {s['p50_ms']:.1f} / {s['p99_ms']:.1f} | {s['p99_ms'] / h['p99_ms']:.2f} |")
PY
finish
