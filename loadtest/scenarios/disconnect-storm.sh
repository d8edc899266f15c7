#!/usr/bin/env bash
# Disconnect storm: many streaming clients drop their connection mid-stream (after the first
# chunk, and later after a few), through the router; P and D must end holding and using no
# blocks well within P's lease, no child may die, and the mesh must still serve afterwards.
SCENARIO=disconnect-storm
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13030}"
COST_US=${COST_US:-50} LEASE_S=5 start_mesh storm

log "storm 1: 32 clients, 400 requests, 80% dropped after the first chunk"
load early --concurrency 32 --requests "${REQUESTS:-400}" --output-len 128 --disconnect-fraction 0.8 --disconnect-after 1
check_report
log "storm 2: Poisson 100 req/s for 10 s, 50% dropped after 8 chunks"
load late --rate 100 --duration 10 --output-len 128 --disconnect-fraction 0.5 --disconnect-after 8
check_report
log "afterwards every request is served"
load after --concurrency 4 --requests 32 --output-len 16
check_report '^$' 1.0

check_idle 20
finish
