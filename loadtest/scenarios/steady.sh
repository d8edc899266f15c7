#!/usr/bin/env bash
# Steady state: open-loop Poisson arrivals at RATE req/s for DURATION seconds on a synthetic
# P/D mesh (COST_US per token), random lengths, goodput against TTFT/TPOT SLOs; then P and D
# must hold and use no blocks and no child may have died.
SCENARIO=steady
source "$(dirname "$0")/lib.sh"
mesh_ports "${PDMESH_SCENARIO_PORT:-13010}"
COST_US=${COST_US:-50} start_mesh steady

log "Poisson ${RATE:=40} req/s for ${DURATION:=60} s, input 8-64 words, output 32-128 tokens"
load "rate$RATE" --rate "$RATE" --duration "$DURATION" --warmup 20 --input-len 8-64 --output-len 32-128 \
  --slo-ttft-ms "${SLO_TTFT_MS:-200}" --slo-tpot-ms "${SLO_TPOT_MS:-20}" --progress
check_report '^$' 1.0

check_idle 20
finish
