#!/usr/bin/env bash
# Hostile load (issue 40): for DURATION seconds a synthetic P/D mesh serves 8 honest
# closed-loop streams through the router while, all at the same time,
#   - `pdmesh-load hostile` attacks: deep-`$ref` and huge-`guided_choice` requests against the
#     router, P and D; side-channel peers that send P frames of 2 × 200 KiB (request id, trace)
#     and never read; a flood of 2,000 connections saying hello to P's side channel and never
#     answering;
#   - P's frontend is SIGKILLed every KILL_EVERY_S seconds (`pdmesh up` restarts it);
#   - the resident set (VmRSS) of every process of mesh.json (re-read each time, so restarted
#     processes are followed) and of `pdmesh up` is sampled every 5 s.
# Checks:
#   - 0 crashes: every death `pdmesh up` reported is a pid the scenario killed, and every
#     process runs at the end;
#   - every honest request ended with a 200, or a 503 with `Retry-After` and an OpenAI error
#     body (`http_503`; a 503 without `Retry-After` is its own error kind; the honest clients
#     wait what `Retry-After` says before their next request): nodes end a request
#     at `limits.request_deadline_s` (DEADLINE_S) and the client gives up 30 s later, so a
#     request that outlived its deadline shows as a 504, an error event or a timeout — none is
#     allowed;
#   - every hostile schema request was refused: a 400 within MAX_400_MS, or a 503 with
#     `Retry-After` while P's frontend restarted (sent to P directly: refused or reset
#     connections then too), never a 200 or another 5xx; P dropped every silent peer within
#     30 s;
#   - RSS bounded: per process label (a restarted frontend keeps its label), the baseline is the
#     largest sample of the run's second fifth (60–120 s of 300); no later sample may exceed
#     2 × baseline + 64 MiB;
#   - P and D end holding and using nothing, and no hold was left to P's lease (check_idle: the
#     router hands back what a killed P frontend had prefilled once it is up again).
# Report: results/hostile/hostile.md (and hostile/hostile.json, honest/report.json, rss.tsv).
#
# Knobs: DURATION (300), KILL_EVERY_S (30), DEADLINE_S (60), MAX_400_MS (5000), COST_US
# (1000), FLOOD (2000 connections), SILENT (4 peers at a time), LEASE_S (30).
SCENARIO=hostile
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13090}"
DURATION=${DURATION:-300}
KILL_EVERY_S=${KILL_EVERY_S:-30}
DEADLINE_S=${DEADLINE_S:-60}
MAX_400_MS=${MAX_400_MS:-5000}
OUT="$RESULTS_DIR/$SCENARIO"
mkdir -p "$OUT"

# P's hold lease is the product's default (30 s), not lib.sh's 5 s: what a killed P frontend had
# prefilled can only be handed back through that frontend once it is up again, and `pdmesh up`
# restarts a frontend killed every 30 s after a growing backoff (up to 8 s).
COST_US=${COST_US:-1000} LEASE_S=${LEASE_S:-30} LIMITS="request_deadline_s = $DEADLINE_S" start_mesh hostile

# rss_sampler: every 5 s, "t_s label pid rss_kib" for each live process of mesh.json and for
# `pdmesh up` itself, appended to $OUT/rss.tsv.
rss_sampler() {
  local t0=$SECONDS
  : >"$OUT/rss.tsv"
  while :; do
    python3 - "$RUN_DIR/mesh.json" "$((SECONDS - t0))" <<'PY' >>"$OUT/rss.tsv" || true
import json, sys
per_rank = ("engine-core", "connector-scheduler", "connector-worker")
mesh = json.load(open(sys.argv[1]))
procs = [("up", mesh["up_pid"])]
for p in mesh["processes"]:
    if p["alive"]:
        rank = f'.{p["rank"]}' if p["service"] in per_rank else ""
        procs.append((f'{p["node"]}.{p["service"]}{rank}', p["pid"]))
for label, pid in procs:
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        continue  # gone since mesh.json was written
    kib = next((l.split()[1] for l in status.splitlines() if l.startswith("VmRSS:")), None)
    if kib is not None:
        print(sys.argv[2], label, pid, kib)
PY
    sleep 5
  done
}

# killer: SIGKILL P's frontend every KILL_EVERY_S seconds until DURATION; each pid killed is
# appended to $OUT/killed.pids. A frontend still down (restart backoff) is skipped.
killer() {
  local start=$SECONDS next=$KILL_EVERY_S pid
  : >"$OUT/killed.pids"
  while ((next < DURATION)); do
    sleep $((start + next - SECONDS > 0 ? start + next - SECONDS : 0))
    pid=$(python3 -c '
import json, sys
for p in json.load(open(sys.argv[1]))["processes"]:
    if p["node"] == "p" and p["service"] == "frontend" and p["alive"]:
        print(p["pid"])' "$RUN_DIR/mesh.json" 2>/dev/null || true)
    if [[ -n "$pid" ]] && kill -KILL "$pid" 2>/dev/null; then
      echo "$pid" >>"$OUT/killed.pids"
      log "  killed P's frontend (pid $pid) at $((SECONDS - start)) s"
    else
      log "  P's frontend not running at $((SECONDS - start)) s: no kill"
    fi
    next=$((next + KILL_EVERY_S))
  done
}

log "${DURATION} s: 8 honest streams, the hostile attackers, P's frontend killed every ${KILL_EVERY_S} s"
rss_sampler &
sampler_pid=$!
killer &
killer_pid=$!
"$LOAD" hostile --url "$ROUTER" --also-url "$P_URL" --also-url "$D_URL" \
  --side-channel "tcp://127.0.0.1:$SIDE_PORT" --duration "$DURATION" \
  --flood-connections "${FLOOD:-2000}" --silent-peers "${SILENT:-4}" \
  --out-dir "$OUT/hostile" 2>"$OUT/hostile.log" &
hostile_pid=$!
load honest --concurrency 8 --duration "$DURATION" --output-len 32-96 \
  --request-timeout-s $((DEADLINE_S + 30)) --respect-retry-after &
load_pid=$!

wait "$load_pid" || true
wait "$hostile_pid" || fail "pdmesh-load hostile exited non-zero (see $OUT/hostile.log)"
wait "$killer_pid" || true
kill "$sampler_pid" 2>/dev/null || true
wait "$sampler_pid" 2>/dev/null || true

LAST_REPORT="$OUT/honest/report.json"
if [[ -f "$LAST_REPORT" ]]; then
  check_report '^http_503$'
else
  fail "no honest report"
fi

# The attackers' answers: refused, and quickly.
python3 - "$OUT/hostile/hostile.json" "$ROUTER" "$MAX_400_MS" <<'PY' || fail "hostile schema requests not refused as they must be"
import json, sys
r = json.load(open(sys.argv[1])); router = sys.argv[2]; max_ms = float(sys.argv[3])
problems = []
for a in r["schema_attacks"]:
    # Through the router a restarting P is a 503; sent to P directly, a refused or reset
    # connection.
    allowed = {"http_400", "http_503"} | (set() if a["target"] == router else {"connect", "transport"})
    bad = {k: v for k, v in a["outcomes"].items() if k not in allowed}
    if bad:
        problems.append(f'{a["attack"]} at {a["target"]}: {bad}')
    if not a["outcomes"].get("http_400"):
        problems.append(f'{a["attack"]} at {a["target"]}: no 400 at all')
    if a["latency_400_max_ms"] > max_ms:
        problems.append(f'{a["attack"]} at {a["target"]}: a 400 took {a["latency_400_max_ms"]:.0f} ms')
for name in ("silent_peers", "handshake_flood"):
    if not r[name] or not r[name]["frames_sent"]:
        problems.append(f"{name}: sent nothing")
if r["silent_peers"] and r["silent_peers"]["held_open"]:
    problems.append(f'P kept {r["silent_peers"]["held_open"]} silent peers connected for 30 s')
if problems:
    print("  " + "\n  ".join(problems), file=sys.stderr); sys.exit(1)
PY

# 0 crashes: every death up reported is a pid killed here.
python3 - "$RUN_DIR/up.log" "$OUT/killed.pids" <<'PY' || fail "a process died that the scenario did not kill"
import re, sys
killed = set(open(sys.argv[2]).read().split())
deaths = re.findall(r"pdmesh up: (\S+) \(pid (\d+)\) died", open(sys.argv[1]).read())
crashes = [f"{label} (pid {pid})" for label, pid in deaths if pid not in killed]
print(f"  {len(deaths)} deaths reported by pdmesh up, {len(killed)} kills", file=sys.stderr)
if crashes:
    print(f"  crashed: {crashes}", file=sys.stderr); sys.exit(1)
PY
KILLED="p.frontend"

python3 - "$OUT/rss.tsv" "$DURATION" <<'PY' >"$OUT/rss.md" || fail "RSS grew past its bound"
import collections, sys
duration = float(sys.argv[2]); lo, hi = duration / 5, 2 * duration / 5
slack_kib = 64 * 1024
samples = collections.defaultdict(list)
for line in open(sys.argv[1]):
    t, label, pid, kib = line.split()
    samples[label].append((float(t), int(pid), int(kib)))
bad = []
print("| process | pids | baseline MiB | max MiB | last MiB | bound MiB |")
print("|---|---|---|---|---|---|")
for label in sorted(samples):
    s = samples[label]
    window = [k for t, _, k in s if lo <= t < hi]
    baseline = max(window) if window else None
    later = [k for t, _, k in s if t >= hi]
    peak, last = max(k for _, _, k in s), s[-1][2]
    bound = None if baseline is None else 2 * baseline + slack_kib
    if bound is not None and later and max(later) > bound:
        bad.append(f"{label}: {max(later) / 1024:.0f} MiB after a baseline of {baseline / 1024:.0f} MiB")
    mib = lambda k: "–" if k is None else f"{k / 1024:.0f}"
    print(f"| {label} | {len({p for _, p, _ in s})} | {mib(baseline)} | {mib(peak)} | {mib(last)} | {mib(bound)} |")
if bad:
    print("  " + "; ".join(bad), file=sys.stderr); sys.exit(1)
PY
cat "$OUT/rss.md" >&2

check_idle 40
held_end=$(curl -fsS "$P_URL/debug/kv" 2>/dev/null | python3 -c 'import sys,json; v=json.load(sys.stdin); print(v["held_blocks"], v["used_blocks"])' 2>/dev/null || echo "? ?")
held_end_d=$(curl -fsS "$D_URL/debug/kv" 2>/dev/null | python3 -c 'import sys,json; v=json.load(sys.stdin); print(v["held_blocks"], v["used_blocks"])' 2>/dev/null || echo "? ?")

python3 - "$OUT" "$DURATION" "$KILL_EVERY_S" "$held_end" "$held_end_d" "$(stranded)" <<'PY' >"$OUT/hostile.md"
import json, sys
out, duration, every, p_end, d_end, stranded = sys.argv[1:]
h = json.load(open(f"{out}/honest/report.json"))["summary"]
r = json.load(open(f"{out}/hostile/hostile.json"))
kills = len(open(f"{out}/killed.pids").read().split())
print(f"# Hostile load, {duration} s, P's frontend killed every {every} s ({kills} kills)\n")
errors = ", ".join(f"{k} {v}" for k, v in sorted(h["errors_by_kind"].items())) or "none"
print(f"Honest (8 closed-loop streams): {h['requests_sent']} sent, {h['succeeded']} ok, errors: {errors}; "
      f"TTFT p50 {h['ttft_ms']['p50_ms']:.1f} ms, p99 {h['ttft_ms']['p99_ms']:.1f} ms; E2E p99 {h['e2e_ms']['p99_ms']:.0f} ms.\n")
print("| attack | target | sent | outcomes | 400 p50 / max ms |")
print("|---|---|---|---|---|")
for a in r["schema_attacks"]:
    o = ", ".join(f"{k} {v}" for k, v in sorted(a["outcomes"].items()))
    q = a["latency_400_ms"]["p50_ms"]
    print(f"| {a['attack']} | {a['target']} | {a['sent']} | {o} | {'–' if q is None else f'{q:.0f}'} / {a['latency_400_max_ms']:.0f} |")
print()
z, c = r["silent_peers"], r["config"]
print(f"Silent peers ({c['silent_peers']} at a time, each queueing up to {c['frames_per_connection']} frames of "
      f"2 x {c['frame_kib']} KiB and never reading): {z['connects']} connections ({z['connect_failures']} failed), "
      f"{z['dropped_by_p']} dropped by P, the slowest {z['drop_ms_max']} ms after its connect; "
      f"{z['held_open']} kept 30 s.\n")
z = r["handshake_flood"]
print(f"Handshake flood ({c['flood_connections']} connections, a hello each every {c['flood_resend_ms']} ms): "
      f"{z['connects']} connects ({z['connect_failures']} failed), {z['frames_sent']} hellos, "
      f"{z['dropped_by_p']} connections dropped by P, {z['stalled']} stalled sends.\n")
print()
print(open(f"{out}/rss.md").read())
print(f"At the end: P held/used {p_end}, D held/used {d_end}; block-seconds P's lease freed: {float(stranded):.1f}.")
PY
cat "$OUT/hostile.md" >&2
finish
