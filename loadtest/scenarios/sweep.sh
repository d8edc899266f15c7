#!/usr/bin/env bash
# Concurrency sweep: closed loop at each of CONCURRENCIES on one synthetic P/D mesh, 64
# output tokens; writes a table of every step to results/sweep/sweep.md and ends with the
# lifecycle checks.
SCENARIO=sweep
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13020}"
COST_US=${COST_US:-50} start_mesh sweep

reports=()
for c in ${CONCURRENCIES:-1 4 16 64}; do
  n=$(( c * 8 > ${MIN_REQUESTS:-100} ? c * 8 : ${MIN_REQUESTS:-100} ))
  log "concurrency $c: $n requests"
  load "c$c" --concurrency "$c" --requests "$n" --warmup "$c" --output-len 64 \
    --slo-ttft-ms "${SLO_TTFT_MS:-200}" --slo-tpot-ms "${SLO_TPOT_MS:-20}"
  check_report '^$' 1.0
  reports+=("$LAST_REPORT")
done

python3 - "$RESULTS_DIR/sweep/sweep.md" "${reports[@]}" <<'PY'
import json, sys
rows = ["| concurrency | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | E2E p50 / p99 ms | goodput req/s | errors |",
        "|---|---|---|---|---|---|---|---|"]
for path in sys.argv[2:]:
    r = json.load(open(path)); s = r["summary"]
    g = s["goodput"]["goodput_rps"] if s["goodput"] else float("nan")
    f = lambda x: "–" if x["p50_ms"] is None else f"{x['p50_ms']:.2f} / {x['p99_ms']:.2f}"
    rows.append(f"| {r['config']['concurrency']} | {s['request_throughput_rps']:.1f} | {s['output_token_throughput_tps']:.0f} | "
                f"{f(s['ttft_ms'])} | {f(s['tpot_ms'])} | {f(s['e2e_ms'])} | {g:.1f} | {s['failed']} |")
open(sys.argv[1], "w").write("\n".join(rows) + "\n")
print("\n".join(rows), file=sys.stderr)
PY

check_idle 20
finish
