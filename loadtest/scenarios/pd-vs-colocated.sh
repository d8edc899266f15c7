#!/usr/bin/env bash
# P/D against colocated at equal load, side by side: a P/D mesh (router → P → D) and a
# colocated node with the same model run at the same time on this machine; each round loads
# one, then the other (the order alternates), at every concurrency of CONCURRENCIES, closed
# loop, streaming chat, 64 output tokens. Prints TTFT and ITL (medians over ROUNDS of each
# run's p50 and p99) and output throughput (all rounds' tokens over all rounds' time, so that
# with an even ROUNDS each setup is loaded first and second equally often), each round's
# ratios, issue #22's verdict on each setup's undisturbed level (pd_vs_colocated.py, D79), and
# ends with the P/D mesh's lifecycle checks. Both meshes serve a warm-up
# load first, unmeasured: a mesh's first seconds under load are slower (first prefills of the
# shared prompt prefix, first handshake, first touch of cache pages).
#
#   MODEL=gguf (default here; `synthetic` for a quick check), ROUNDS (4; issue #22's verdict
#   runs use `MIN_REQUESTS=48 PER_STREAM=16 ROUNDS=8`), CONCURRENCIES ("1 4 8"),
#   PER_STREAM (8: requests per stream and setup; longer runs steady the throughput ratio, which
#   varies by ±10 % between 8-request runs on a shared machine), MIN_REQUESTS (16: the fewest
#   requests of a run whatever its streams; the one-stream TTFT median moves by ~1 ms between
#   16-request runs, as the benchmark's prompts differ in what they leave uncached),
#   ROUTER_EXTRA (router keys: `local_prefill_max_tokens = 16` lets D prefill the prompts it
#   already holds instead of asking P, D69)
#
# On one machine P/D cannot win: P's and D's workers share the cores the colocated node has
# to itself, and each request makes a second HTTP leg. What it measures is the cost of
# disaggregation in TTFT and ITL; docs/benchmarks.md.
SCENARIO=pd-vs-colocated
MODEL=${MODEL:-gguf}
# D's engine is configured as the colocated node's (below), max_model_len included (the other
# scenarios give D 2048): the two decode nodes compared differ only in being disaggregated.
D_MAX_LEN=${D_MAX_LEN:-8192}
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13080}"
start_mesh pd

start_colocated
trap 'stop_colocated; stop_mesh' EXIT
wait_engines "$COLO_URL" 60 || { log "colocated node did not come up"; tail -20 "$COLO_DIR/up.log" >&2; exit 1; }

ROUNDS=${ROUNDS:-4}
# A run's rounds replace the last run's whole: `pd_vs_colocated.py --verdict` reads every round
# a directory holds, so rounds left over from a longer run would join this one.
rm -rf "${RESULTS_DIR:?}/$SCENARIO"
# Warm-up, unmeasured: both meshes at the highest concurrency, 4 requests per stream.
warm=0
for c in ${CONCURRENCIES:-1 4 8}; do if (( c > warm )); then warm=$c; fi; done
for url in "$ROUTER" "$COLO_URL"; do
  "$LOAD" run --url "$url" --endpoint chat --concurrency "$warm" --requests $(( warm * 4 )) --output-len 64 \
    --out-dir "$RESULTS_DIR/$SCENARIO/warmup" 2>/dev/null || fail "warm-up load against $url failed"
done
rm -rf "$RESULTS_DIR/$SCENARIO/warmup"
for r in $(seq 1 "$ROUNDS"); do
  for c in ${CONCURRENCIES:-1 4 8}; do
    n=$(( c * ${PER_STREAM:-8} > ${MIN_REQUESTS:-16} ? c * ${PER_STREAM:-8} : ${MIN_REQUESTS:-16} ))
    order=(colocated pd)
    (( r % 2 == 0 )) && order=(pd colocated)
    for setup in "${order[@]}"; do
      log "round $r/$ROUNDS, $c streams: $setup"
      topo="$RUN_DIR/topology.toml"
      [[ $setup == colocated ]] && topo="$COLO_DIR/topology.toml"
      mkdir -p "$RESULTS_DIR/$SCENARIO"
      cpu_before="$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r.cpu0"
      python3 "$(dirname "$0")/cpu_by_service.py" snapshot "$topo" >"$cpu_before"
      workers=(p="$P_WORKER_METRICS" d="http://127.0.0.1:$((BASE_PORT + 400 + 112))/metrics")
      [[ $setup == colocated ]] && workers=(colocated="http://127.0.0.1:$((BASE_PORT + 600 + 112))/metrics")
      python3 "$(dirname "$0")/worker_steps.py" snapshot "${workers[@]}" >"$cpu_before.steps"
      # Both setups are loaded by the same command, without `load`'s scraping of the P/D
      # mesh's metrics pages: five pages rendered a second by P/D's processes and none by the
      # colocated node's would tilt the comparison (the lifecycle checks below read the pages
      # once, after the load).
      url=$ROUTER
      [[ $setup == colocated ]] && url=$COLO_URL
      LAST_REPORT="$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r/report.json"
      mkdir -p "$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r"
      head -1 /proc/stat >"$cpu_before.host"
      "$LOAD" run --url "$url" --endpoint chat --concurrency "$c" --requests "$n" --warmup "$c" --output-len 64 \
        --out-dir "$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r" 2>"$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r.log" \
        || fail "pdmesh-load against the $setup setup exited non-zero"
      # The host's CPU counters around the load alone: the summary prints each round's share of
      # the vCPUs' time the hypervisor gave elsewhere (steal), the noise these ratios carry.
      { cat "$cpu_before.host"; head -1 /proc/stat; } >"$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r/host_cpu.txt"
      check_report
      tokens=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["summary"]; print(s.get("output_tokens") or 0)' \
        "$LAST_REPORT")
      python3 "$(dirname "$0")/cpu_by_service.py" snapshot "$topo" >"$cpu_before.after"
      python3 "$(dirname "$0")/worker_steps.py" snapshot "${workers[@]}" >"$cpu_before.steps.after"
      python3 "$(dirname "$0")/worker_steps.py" diff "$cpu_before.steps" "$cpu_before.steps.after" "$tokens" \
        >"$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r/steps.json"
      python3 "$(dirname "$0")/cpu_by_service.py" diff "$cpu_before" "$cpu_before.after" "$tokens" \
        >"$RESULTS_DIR/$SCENARIO/$setup-c$c-r$r/cpu.json"
      rm -f "$cpu_before" "$cpu_before.after" "$cpu_before.steps" "$cpu_before.steps.after" "$cpu_before.host"
    done
  done
done

python3 "$(dirname "$0")/pd_vs_colocated.py" "$RESULTS_DIR/$SCENARIO" "$ROUNDS" ${CONCURRENCIES:-1 4 8} \
  | tee "$RESULTS_DIR/$SCENARIO/summary.md" >&2

check_idle 20
stop_colocated
trap stop_mesh EXIT
finish
