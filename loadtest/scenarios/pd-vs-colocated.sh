#!/usr/bin/env bash
# P/D against colocated at equal load, side by side: a P/D mesh (router → P → D) and a
# colocated node with the same model run at the same time on this machine; each round loads
# one, then the other (the order alternates), at every concurrency of CONCURRENCIES, closed
# loop, streaming chat, 64 output tokens. Prints TTFT, ITL and aggregate output throughput of
# both (medians over ROUNDS) and ends with the P/D mesh's lifecycle checks.
#
#   MODEL=gguf (default here; `synthetic` for a quick check), ROUNDS (3), CONCURRENCIES ("1 4 8"),
#   PER_STREAM (8: requests per stream and setup, at least 16 in all; longer runs steady the
#   throughput ratio, which varies by ±10 % between 8-request runs on a shared machine)
#
# On one machine P/D cannot win: P's and D's workers share the cores the colocated node has
# to itself, and each request makes a second HTTP leg. What it measures is the cost of
# disaggregation in TTFT and ITL; docs/benchmarks.md.
SCENARIO=pd-vs-colocated
MODEL=${MODEL:-gguf}
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13080}"
start_mesh pd

# The colocated node: next to the P/D mesh's ports (HTTP+3, base ports above the mesh's).
COLO_URL="http://127.0.0.1:$((HTTP_PORT + 3))"
COLO_DIR="$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-scenario-colocated.XXXXXX")"
cat >"$COLO_DIR/topology.toml" <<EOF
run_dir = "$COLO_DIR"

[[nodes]]
name = "colocated"
role = "colocated"
http_port = $((HTTP_PORT + 3))
base_port = $((BASE_PORT + 600))
$(model_line)
engine = { block_size = 16, num_blocks = 512, max_model_len = 8192, max_num_seqs = 128 }
EOF
RUST_LOG="${RUST_LOG:-warn}" PDMESH_RUN_DIR="$COLO_DIR" "$PDMESH" up --topology "$COLO_DIR/topology.toml" \
  >"$COLO_DIR/up.out" 2>"$COLO_DIR/up.log" &
COLO_PID=$!
stop_colocated() {
  kill -TERM "$COLO_PID" 2>/dev/null || true
  wait "$COLO_PID" 2>/dev/null || true
  rm -rf "$COLO_DIR"
}
trap 'stop_colocated; stop_mesh' EXIT
wait_engines "$COLO_URL" 60 || { log "colocated node did not come up"; tail -20 "$COLO_DIR/up.log" >&2; exit 1; }

ROUNDS=${ROUNDS:-3}
for r in $(seq 1 "$ROUNDS"); do
  for c in ${CONCURRENCIES:-1 4 8}; do
    n=$(( c * ${PER_STREAM:-8} > 16 ? c * ${PER_STREAM:-8} : 16 ))
    order=(colocated pd)
    (( r % 2 == 0 )) && order=(pd colocated)
    for setup in "${order[@]}"; do
      log "round $r/$ROUNDS, $c streams: $setup"
      topo="$RUN_DIR/topology.toml"
      [[ $setup == colocated ]] && topo="$COLO_DIR/topology.toml"
      mkdir -p "$RESULTS_DIR/$SCENARIO"
      cpu_before="$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r.cpu0"
      python3 "$(dirname "$0")/cpu_by_service.py" snapshot "$topo" >"$cpu_before"
      if [[ $setup == pd ]]; then
        load "pd-c$c-r$r" --endpoint chat --concurrency "$c" --requests "$n" --warmup "$c" --output-len 64
        check_report
      else
        mkdir -p "$RESULTS_DIR/$SCENARIO"
        "$LOAD" run --url "$COLO_URL" --endpoint chat --concurrency "$c" --requests "$n" --warmup "$c" --output-len 64 \
          --out-dir "$RESULTS_DIR/$SCENARIO/colocated-c$c-r$r" 2>"$RESULTS_DIR/$SCENARIO/colocated-c$c-r$r.log" \
          || fail "pdmesh-load against the colocated node exited non-zero"
      fi
      tokens=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["summary"]; print(s.get("output_tokens") or 0)' \
        "$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r/report.json")
      python3 "$(dirname "$0")/cpu_by_service.py" snapshot "$topo" >"$cpu_before.after"
      python3 "$(dirname "$0")/cpu_by_service.py" diff "$cpu_before" "$cpu_before.after" "$tokens" \
        >"$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r/cpu.json"
      rm -f "$cpu_before" "$cpu_before.after"
    done
  done
done

python3 - "$RESULTS_DIR/$SCENARIO" "$ROUNDS" ${CONCURRENCIES:-1 4 8} <<'PY' | tee "$RESULTS_DIR/$SCENARIO/summary.md" >&2
import json, statistics, sys
out, rounds, cs = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3:]]
def med(setup, c):
    rs = [json.load(open(f"{out}/{setup}-c{c}-r{r}/report.json"))["summary"] for r in range(1, rounds + 1)]
    bad = [s["failed"] for s in rs if s["failed"]]
    if bad:
        sys.exit(f"{setup} at {c} streams: failed requests {bad}")
    m = lambda f: statistics.median(f(s) for s in rs)
    return {"tps": m(lambda s: s["output_token_throughput_tps"]),
            "ttft": m(lambda s: s["ttft_ms"]["p50_ms"]), "ttft99": m(lambda s: s["ttft_ms"]["p99_ms"]),
            "itl": m(lambda s: s["itl_ms"]["p50_ms"]), "itl99": m(lambda s: s["itl_ms"]["p99_ms"])}
print("| streams | colocated: tok/s, TTFT p50 / p99, ITL p50 / p99 | P/D: tok/s, TTFT p50 / p99, ITL p50 / p99 | P/D ÷ colocated: tok/s, TTFT p50, ITL p50 |")
print("|---|---|---|---|")
for c in cs:
    a, b = med("colocated", c), med("pd", c)
    f = lambda x: f"{x['tps']:.0f}, {x['ttft']:.0f} / {x['ttft99']:.0f} ms, {x['itl']:.1f} / {x['itl99']:.1f} ms"
    print(f"| {c} | {f(a)} | {f(b)} | {b['tps'] / a['tps']:.2f}×, {b['ttft'] / a['ttft']:.2f}×, {b['itl'] / a['itl']:.2f}× |")
# Where the cores' time goes: CPU ms per output token by service, summed over the rounds.
def cpu(setup, c):
    tot, tokens = {}, 0
    for r in range(1, rounds + 1):
        try:
            d = json.load(open(f"{out}/{setup}-c{c}-r{r}/cpu.json"))
        except OSError:
            return None
        tokens += d["tokens"]
        for k, v in d["cpu_ms"].items():
            tot[k] = tot.get(k, 0) + v
    return {k: v / max(tokens, 1) for k, v in tot.items()}
print()
print("CPU ms per output token (user + system, all of each mesh's processes):")
print()
print("| streams | colocated | P/D | colocated by service (≥ 0.05 ms) | P/D by service (≥ 0.05 ms) |")
print("|---|---|---|---|---|")
for c in cs:
    a, b = cpu("colocated", c), cpu("pd", c)
    if a is None or b is None:
        continue
    top = lambda x: ", ".join(f"{k} {v:.2f}" for k, v in sorted(x.items(), key=lambda kv: -kv[1]) if v >= 0.05)
    print(f"| {c} | {sum(a.values()):.2f} | {sum(b.values()):.2f} | {top(a)} | {top(b)} |")
PY

check_idle 20
stop_colocated
trap stop_mesh EXIT
finish
