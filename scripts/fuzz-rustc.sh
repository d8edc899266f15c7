#!/usr/bin/env bash
# rustc wrapper of the fuzz build (scripts/fuzz.sh sets RUSTC_WRAPPER to it): adds libFuzzer's
# coverage instrumentation (SanitizerCoverage: inline 8-bit counters, PC table, comparison
# tracing) and overflow checks to the pdmesh crates of that build, and nothing else.
#
# Only crates whose artifacts belong to the fuzz build alone are touched: pdmesh-protocol with
# its `fuzzing` feature, and every pdmesh crate compiled against it. Their hashes differ from
# the service build's, so the service build never links an instrumented artifact, and every
# third-party crate is the very artifact the service build made (D42).
set -euo pipefail
rustc=$1
shift
args=" $* "
if [[ -n "${PDMESH_FUZZ_INSTRUMENT:-}" && "$args" == *" --crate-name pdmesh_"* &&
      ( "$args" == *'feature="fuzzing"'* || "$args" == *" --extern pdmesh_protocol="* ) ]]; then
  exec "$rustc" "$@" \
    -Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares \
    -Cdebug-assertions=on \
    -Coverflow-checks=on
fi
exec "$rustc" "$@"
