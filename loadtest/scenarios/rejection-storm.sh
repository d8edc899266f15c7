#!/usr/bin/env bash
# Rejection storm (rule R1, notices on versus off): `pdmesh-load rejections` runs three meshes
# side by side — no rejections (baseline), 1 request in 10 refused by D with notices on, the
# same with notices off (P frees only at its lease deadline) — and this script asserts the
# lifecycle figures of its report: with notices on, the refused requests strand at most a small
# fraction of what the deadline alone strands, throughput keeps ≥ MIN_RATIO of the baseline,
# and every request is answered (a success or D's 400) in every variant. Report:
# results/rejection-storm/report.json (docs/LOADTEST.md, docs/benchmarks.md).
SCENARIO=rejection-storm
source "$(dirname "$0")/lib.sh"
out="$RESULTS_DIR/$SCENARIO"
mkdir -p "$out"
log "three meshes, ${ROUNDS:-2} rounds of ${REQUESTS:-300} requests each"
"$LOAD" rejections --rounds "${ROUNDS:-2}" --requests "${REQUESTS:-300}" --lease-s "${LEASE_S:-5}" \
  --out "$out/report.json" > "$out/stdout.json" 2> "$out/progress.log" || fail "pdmesh-load rejections exited $?"
python3 - "$out/report.json" "${MIN_RATIO:-0.98}" "${MAX_STRANDED_SHARE:-0.05}" <<'PY' || FAILURES=$((FAILURES + 1))
import json, sys
report = json.load(open(sys.argv[1]))
min_ratio, max_share = float(sys.argv[2]), float(sys.argv[3])
v = report["variants"] if "variants" in report else report
on, off, base = v["notices_on"], v["notices_off"], v["baseline"]
problems = []
for name, row in (("baseline", base), ("notices_on", on), ("notices_off", off)):
    if row["other_errors"] != 0:
        problems.append(f"{name}: {row['other_errors']} requests neither served nor cleanly refused")
if on["rejected_by_d"] == 0:
    problems.append("notices_on: D refused nothing (the storm did not happen)")
if off["stranded_block_seconds"] <= 0:
    problems.append("notices_off: nothing stranded, so the baseline shows nothing")
share = on["stranded_block_seconds"] / max(off["stranded_block_seconds"], 1e-9)
if share > max_share:
    problems.append(f"notices_on strands {share:.1%} of the deadline-only figure (max {max_share:.0%})")
if on["ratio_to_baseline"] < min_ratio:
    problems.append(f"notices_on throughput {on['ratio_to_baseline']:.2f}x baseline (min {min_ratio})")
print(f"rejection-storm: notices on {on['ratio_to_baseline']:.2f}x baseline, stranded "
      f"{on['stranded_block_seconds']:.0f} vs {off['stranded_block_seconds']:.0f} block-s off ({share:.1%}); "
      f"rejection->release p50/p99 <= {on.get('rejection_to_release_p50_le_s')}/{on.get('rejection_to_release_p99_le_s')} s",
      file=sys.stderr)
for p in problems:
    print("rejection-storm: FAIL:", p, file=sys.stderr)
sys.exit(1 if problems else 0)
PY
finish
