#!/usr/bin/env bash
# Fault injection (the product's own, docs/KV_TRANSFER.md): for each fault, one mesh whose D
# recomputes a failed KV load and one whose D fails the request. Under `recompute` every
# request must succeed and D must count recomputed loads; under `fail` each failed load must
# come back as an error answer (a 5xx, or an `error` event once the stream has started; never
# a cut connection) and be counted; in both P and D end holding nothing (within
# P's 3 s lease where D cannot tell P) and no child dies.
SCENARIO=faults
source "$(dirname "$0")/lib.sh"
port=${PDMESH_SCENARIO_PORT:-13040}

# side:fault pairs; P-side faults go to P's topology, D-side ones to D's.
for case in ${FAULT_CASES:-p:lease_refused d:transfer_midway d:transfer_setup_error}; do
  side=${case%%:*}; fault=${case#*:}
  for policy in recompute fail; do
    mesh_ports "$port"
    P_FAULT=""; D_FAULT=""
    if [[ $side == p ]]; then P_FAULT=$fault; else D_FAULT=$fault; fi
    log "fault $fault on $side, policy $policy"
    COST_US=20 LEASE_S=3 POLICY=$policy start_mesh "$fault-$policy"
    load "$fault-$policy" --concurrency 4 --requests "${REQUESTS:-40}" --output-len 16
    failed_loads=$(metric "${D_ENGINE_METRICS[0]}" pdmesh_engine_kv_load_failed_requests_total)
    recomputed=$(metric "${D_ENGINE_METRICS[0]}" pdmesh_engine_kv_loads_recomputed_total)
    if [[ $policy == recompute ]]; then
      check_report '^$' 1.0
      [[ "$recomputed" != missing && "$recomputed" != 0.0 ]] || fail "$fault/recompute: D recomputed $recomputed loads"
    else
      check_report '^(http_5[0-9][0-9]|error_event)$'
      [[ "$failed_loads" != missing && "$failed_loads" != 0.0 ]] || fail "$fault/fail: D failed $failed_loads loads"
    fi
    log "  D: $recomputed loads recomputed, $failed_loads requests failed by a load"
    check_idle 20
    stop_mesh
  done
done
finish
