#!/usr/bin/env bash
# Where P/D's time to first token goes: a P/D mesh and a colocated node (the same as
# pd-vs-colocated.sh) exporting their spans over OTLP to `pdmesh-otlp-sink`, loaded in turn at
# one stream; ttft_breakdown.py then prints each phase of a request (router legs, P's queue and
# prefill, P's answer release, D's admission, the read, D's first step) as median and p90, beside
# the client's TTFT. Tracing costs a little per span, so these runs are not the TTFT figures:
# pd-vs-colocated.sh is.
#
#   MODEL=gguf (default here; `synthetic` for a quick check), REQUESTS (24)
SCENARIO=ttft-breakdown
MODEL=${MODEL:-gguf}
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13080}"
SINK="$BIN_DIR/pdmesh-otlp-sink"
[[ -x "$SINK" ]] || { echo "scenario: $SINK missing; cargo build --release -p pdmesh-otlp-sink" >&2; exit 2; }
SINK_HTTP="127.0.0.1:$((BASE_PORT + 800))"
SINK_DIR="$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-scenario-sink.XXXXXX")"
"$SINK" --grpc "127.0.0.1:$((BASE_PORT + 801))" --http "$SINK_HTTP" --query "127.0.0.1:$((BASE_PORT + 802))" \
  2>"$SINK_DIR/sink.log" &
SINK_PID=$!
export OTEL_EXPORTER_OTLP_ENDPOINT="http://$SINK_HTTP" OTEL_BSP_SCHEDULE_DELAY=200
# Spans are made at info level: a coarser filter would make none.
export RUST_LOG="${RUST_LOG:-info}"
start_mesh pd

start_colocated
stop_all() {
  stop_colocated
  stop_mesh
  kill -TERM "$SINK_PID" 2>/dev/null || true
  wait "$SINK_PID" 2>/dev/null || true
  rm -rf "$SINK_DIR"
}
trap stop_all EXIT
wait_engines "$COLO_URL" 60 || { log "colocated node did not come up"; tail -20 "$COLO_DIR/up.log" >&2; exit 1; }

n=${REQUESTS:-24}
OUT="$RESULTS_DIR/$SCENARIO"
mkdir -p "$OUT"
log "P/D, 1 stream, $n requests"
load pd --endpoint chat --concurrency 1 --requests "$n" --warmup 2 --output-len 16
check_report
log "colocated, 1 stream, $n requests"
"$LOAD" run --url "$COLO_URL" --endpoint chat --concurrency 1 --requests "$n" --warmup 2 --output-len 16 \
  --out-dir "$OUT/colocated" 2>"$OUT/colocated.log" || fail "pdmesh-load against the colocated node exited non-zero"
# Until the exporters' batches stop adding spans (each exports every OTEL_BSP_SCHEDULE_DELAY).
prev=-1
for _ in $(seq 1 30); do
  sleep 1
  curl -fsS "http://$SINK_HTTP/api/spans" >"$OUT/spans.json" || { fail "no spans from the sink"; break; }
  count=$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))))' "$OUT/spans.json")
  ((count > 0 && count == prev)) && break
  prev=$count
done
p50() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["summary"]["ttft_ms"]["p50_ms"])' "$1"; }
python3 "$(dirname "$0")/ttft_breakdown.py" "$OUT/spans.json" "$(p50 "$OUT/pd/report.json")" "$(p50 "$OUT/colocated/report.json")" \
  | tee "$OUT/breakdown.md" >&2
check_idle 20
finish
