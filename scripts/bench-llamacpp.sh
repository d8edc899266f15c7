#!/usr/bin/env bash
# pdmesh side by side with llama.cpp on the same GGUF, the same thread count and the same box,
# in interleaved rounds (this box is shared and noisy: only ratios within one run count).
#
#   engine: llama-bench (pp128, pp512, tg128)  vs  pdmesh-model's `bench` example (same shapes)
#   HTTP:   llama-server (-np 8, continuous batching)  vs  `pdmesh up` on one colocated node,
#           both up at once and driven in turn by the same `pdmesh-load run` closed loop (chat,
#           64 output tokens, ignore_eos, server-default sampling, a new connection per request:
#           llama-server closes kept-alive connections on its own schedule) at 1, 4 and 8
#           concurrent streams
#
# Usage: LLAMA_CPP_BIN=<dir holding llama-bench and llama-server> scripts/bench-llamacpp.sh [MODEL]
#   MODEL: a GGUF file, or a name scripts/fetch-model.sh knows (qwen2.5-0.5b, qwen2.5-1.5b, ...);
#   default: PDMESH_MODEL_PATH, else SmolLM2.
# llama.cpp is built outside this project (recipe in docs/benchmarks.md). Environment:
#   ROUNDS (3), THREADS (2), PART (all | engine | http), OUT (a fresh temp dir),
#   PDMESH_MODEL_PATH (default: scripts/fetch-model.sh), LLAMA_PORT (18080), PDMESH_PORT (8000,
#   the colocated topology's port).
# Prints Markdown tables and leaves raw data in $OUT. Each round runs both engines back to back,
# so the ratio (pdmesh / llama.cpp) is taken per round: the tables give the median ratio over
# rounds and its spread (lowest-highest round), beside each side's median tok/s.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
PART=${PART:-all}
LLAMA_PORT=${LLAMA_PORT:-18080}
PDMESH_PORT=${PDMESH_PORT:-8000}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/pdmesh-vs-llamacpp.XXXXXX")}
mkdir -p "$OUT"
if [[ -n "${1:-}" ]]; then
  if [[ -f "$1" ]]; then MODEL=$1; else MODEL=$(scripts/fetch-model.sh "$1"); fi
else
  MODEL=${PDMESH_MODEL_PATH:-$(scripts/fetch-model.sh)}
fi
log() { echo "[$(date -u +%H:%M:%S)] bench-llamacpp: $*" >&2; }
log "model: $MODEL"
: "${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to the directory holding llama-bench and llama-server}"
for b in "$LLAMA_CPP_BIN/llama-bench" "$LLAMA_CPP_BIN/llama-server"; do
  [[ -x "$b" ]] || { echo "bench-llamacpp: $b missing" >&2; exit 2; }
done

if [[ "$PART" == all || "$PART" == engine ]]; then
  log "building the engine benchmark"
  # --workspace: a `-p` build resolves features differently and rebuilds third-party crates
  CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target} cargo build --release -q --workspace --example bench
  BENCH="${CARGO_TARGET_DIR:-target}/release/examples/bench"
  for r in $(seq 1 "$ROUNDS"); do
    log "engine round $r/$ROUNDS: llama-bench"
    "$LLAMA_CPP_BIN/llama-bench" -m "$MODEL" -t "$THREADS" -p 128,512 -n 128 -r 3 -o jsonl \
      >"$OUT/llama-bench.$r.jsonl" 2>"$OUT/llama-bench.$r.log"
    log "engine round $r/$ROUNDS: pdmesh bench"
    PDMESH_MODEL_PATH="$MODEL" PDMESH_MODEL_THREADS="$THREADS" "$BENCH" 3 >"$OUT/pdmesh-bench.$r.txt" 2>&1
  done
  python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
keys = ("pp128", "pp512", "tg128")
ll = {k: [[] for _ in range(rounds)] for k in keys}
pd = {k: [[] for _ in range(rounds)] for k in keys}
for r in range(rounds):
    for line in open(f"{out}/llama-bench.{r + 1}.jsonl"):
        j = json.loads(line)
        key = f"pp{j['n_prompt']}" if j["n_gen"] == 0 else f"tg{j['n_gen']}"
        if key in ll:
            ll[key][r] += j["samples_ts"]
    for line in open(f"{out}/pdmesh-bench.{r + 1}.txt"):
        m = re.match(r"^(pp128|pp512|tg128) .*?\[(.*)\]", line)
        if m:
            pd[m.group(1)][r] += [float(v) for v in m.group(2).split(",")]
flat = lambda rows: [v for row in rows for v in row]
print("| test | llama.cpp tok/s | pdmesh tok/s | ratio, median of rounds | ratio spread (rounds) |")
print("|---|---|---|---|---|")
for k in keys:
    ratios = sorted(statistics.median(p) / statistics.median(l) for l, p in zip(ll[k], pd[k]) if l and p)
    a, b = flat(ll[k]), flat(pd[k])
    print(f"| {k} | {statistics.median(a):.1f} (n={len(a)}) | {statistics.median(b):.1f} (n={len(b)}) | "
          f"{statistics.median(ratios):.2f}x | {ratios[0]:.2f}-{ratios[-1]:.2f}x ({len(ratios)}) |")
EOF
  echo
  echo "pdmesh load time and memory, per round:"
  grep -h "^load:\|^memory after load" "$OUT"/pdmesh-bench.*.txt | sed 's/^/  /'
fi

if [[ "$PART" == all || "$PART" == http ]]; then
  LOAD=target/release/pdmesh-load
  PDMESH=target/release/pdmesh
  for b in "$LOAD" "$PDMESH"; do
    [[ -x "$b" ]] || { echo "bench-llamacpp: $b missing; cargo build --release -p pdmesh -p pdmesh-loadtest" >&2; exit 2; }
  done
  PIDS=()
  cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
  trap cleanup EXIT
  log "starting llama-server on :$LLAMA_PORT"
  "$LLAMA_CPP_BIN/llama-server" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -c 8192 -np 8 -cram 0 \
    --host 127.0.0.1 --port "$LLAMA_PORT" >"$OUT/llama-server.log" 2>&1 &
  PIDS+=($!)
  log "starting pdmesh (colocated) on :$PDMESH_PORT"
  PDMESH_RUN_DIR="$OUT/pdmesh-run" PDMESH_MODEL_PATH="$MODEL" PDMESH_MODEL_THREADS="$THREADS" RUST_LOG=warn \
    "$PDMESH" up --topology deploy/topology/colocated.toml >"$OUT/pdmesh-up.log" 2>&1 &
  PIDS+=($!)
  for url in "http://127.0.0.1:$LLAMA_PORT" "http://127.0.0.1:$PDMESH_PORT"; do
    deadline=$((SECONDS + 120))
    until curl -fsS "$url/health" >/dev/null 2>&1; do
      ((SECONDS < deadline)) || { log "$url did not come up"; exit 1; }
      sleep 0.5
    done
  done
  mkdir -p "$OUT/http"
  for r in $(seq 1 "$ROUNDS"); do
    for n in 1 4 8; do
      for server in llamacpp pdmesh; do
        port=$LLAMA_PORT
        [[ $server == pdmesh ]] && port=$PDMESH_PORT
        log "http round $r/$ROUNDS: $server, $n streams"
        "$LOAD" run --url "http://127.0.0.1:$port" --endpoint chat --concurrency "$n" --requests $((8 * n)) \
          --warmup "$n" --output-len 64 --fresh-connections --out-dir "$OUT/http/$server-c$n-r$r" >/dev/null 2>"$OUT/http/$server-c$n-r$r.log" \
          || { log "pdmesh-load failed against $server; see $OUT/http/$server-c$n-r$r.log"; exit 1; }
      done
    done
  done
  python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rounds_of(server, n):
    rows = []
    for r in range(1, rounds + 1):
        s = json.load(open(f"{out}/http/{server}-c{n}-r{r}/report.json"))["summary"]
        if s["failed"]:
            sys.exit(f"{server} at {n} streams: {s['failed']} failed requests ({s['errors_by_kind']})")
        rows.append(s)
    return rows
def med(rows, f):
    return statistics.median(f(s) for s in rows)
agg = lambda s: s["output_token_throughput_tps"]
print("| streams | llama.cpp: aggregate tok/s, TTFT p50, ITL p50 | pdmesh: aggregate tok/s, TTFT p50, ITL p50 "
      "| aggregate ratio, median of rounds | spread (rounds) |")
print("|---|---|---|---|---|")
for n in (1, 4, 8):
    a, b = rounds_of("llamacpp", n), rounds_of("pdmesh", n)
    ratios = sorted(agg(y) / agg(x) for x, y in zip(a, b))
    cell = lambda rows: (f"{med(rows, agg):.1f}, {med(rows, lambda s: s['ttft_ms']['p50_ms']):.0f} ms, "
                         f"{med(rows, lambda s: s['itl_ms']['p50_ms']):.1f} ms")
    print(f"| {n} | {cell(a)} | {cell(b)} | {statistics.median(ratios):.2f}x | "
          f"{ratios[0]:.2f}-{ratios[-1]:.2f}x ({len(ratios)}) |")
EOF
fi
log "raw data in $OUT"
