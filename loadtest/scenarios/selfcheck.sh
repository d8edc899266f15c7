#!/usr/bin/env bash
# Self-check of the lifecycle checks: the smoke scenario with one figure broken on purpose
# (SMOKE_BREAK, see smoke.sh) must exit 1, and for the right reason. If a broken figure
# passes, the checks could not catch it, and this script fails. Runs in about a minute.
#
#   SELFCHECK_CASES   which breaks (default: stranded held hang death)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
port=${PDMESH_SCENARIO_PORT:-13070}

# break → what the failing check must say
declare -A expect=(
  [stranded]="stranded block-seconds where D was alive"
  [held]="blocks not released"
  [hang]="unexpected errors {'timeout'"
  [death]="a death was left unrecovered"
)
status=0
rows=("| broken figure | smoke exit | caught by |" "|---|---|---|")
for b in ${SELFCHECK_CASES:-stranded held hang death}; do
  [[ -n "${expect[$b]:-}" ]] || { echo "selfcheck: unknown case $b" >&2; exit 2; }
  out=$(mktemp)
  PDMESH_SCENARIO_PORT=$port SMOKE_BREAK=$b "$ROOT/loadtest/scenarios/smoke.sh" >"$out" 2>&1
  rc=$?
  caught=$(grep -o "FAIL: .*" "$out" | head -3 | cut -c7-90 | paste -sd ';' -)
  if [[ $rc -eq 1 ]] && grep -qF "${expect[$b]}" "$out"; then
    echo "selfcheck: $b: the smoke scenario failed as it must (${expect[$b]})" >&2
    # The failed run keeps its run dir for inspection; here the failure was the point.
    grep -o "run dir kept: [^)]*" "$out" | sed 's/run dir kept: //' | xargs -r rm -rf
  else
    echo "selfcheck: $b: NOT caught (exit $rc, wanted 1 with \"${expect[$b]}\"); its output:" >&2
    cat "$out" >&2
    status=1
  fi
  rows+=("| $b | $rc | ${caught:-–} |")
  rm -f "$out"
done
printf '%s\n' "${rows[@]}" >&2
exit $status
