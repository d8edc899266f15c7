#!/usr/bin/env bash
# Coverage-guided fuzzing of the mesh's input parsers with libFuzzer (docs/SECURITY.md,
# "Fuzzing"; D42). Targets (fuzz/fuzz_targets): envelope, side_channel, tcp_server,
# tcp_client, http_body, guided, topology, gguf.
#
#   scripts/fuzz.sh short            every target FUZZ_SHORT_S (20) s: the test run's campaign
#   scripts/fuzz.sh long             every target FUZZ_LONG_S (600) s: the benchmark campaign
#   scripts/fuzz.sh run TARGET [S]   one target, S seconds (default 60)
#   scripts/fuzz.sh repro TARGET FILE...   replay inputs (a crash or timeout file) once
#   scripts/fuzz.sh build            build the targets only
#
# Fails on any crash (a panic, a failed assertion, memory beyond the limits) or hang (an input
# running past FUZZ_INPUT_TIMEOUT_S), keeping the input under $FUZZ_DIR/artifacts/TARGET/.
# Needs only a stable Rust toolchain and a C++ compiler (installed with apt when missing):
# the instrumentation is stable `-C` flags added to the pdmesh crates by scripts/fuzz-rustc.sh,
# and every third-party crate is the one the service build already made in the same target
# directory. http_body uses the served model's tokenizer and chat template when
# PDMESH_MODEL_PATH names the GGUF file (scripts/test.sh exports it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
target_dir=${CARGO_TARGET_DIR:-$root/target}
FUZZ_DIR=${FUZZ_DIR:-$target_dir/fuzz}
FUZZ_INPUT_TIMEOUT_S=${FUZZ_INPUT_TIMEOUT_S:-10}
TARGETS=(envelope side_channel tcp_server tcp_client http_body guided topology gguf)

need_cxx() {
  command -v c++ >/dev/null 2>&1 && return
  echo "fuzz: no C++ compiler (libFuzzer is C++); installing g++"
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  $sudo apt-get update -qq && $sudo apt-get install -y -qq g++ >/dev/null
}

# The fuzz workspace's lock starts from the root one (same third-party versions); cargo adds
# libFuzzer's few crates to it. Refreshed whenever the root lock changes.
sync_lock() {
  local sum
  sum=$(sha256sum Cargo.lock | cut -d' ' -f1)
  if [[ ! -f fuzz/Cargo.lock || "$(cat fuzz/.root-lock.sha256 2>/dev/null)" != "$sum" ]]; then
    cp Cargo.lock fuzz/Cargo.lock
    echo "$sum" >fuzz/.root-lock.sha256
  fi
}

# The two release profiles must agree, or nothing built for the services is reused.
check_profiles() {
  local a b
  a=$(sed -n '/^\[profile.release\]/,/^\[/p' Cargo.toml | grep -v '^\[' | grep -v '^#' | grep -v '^$' || true)
  b=$(sed -n '/^\[profile.release\]/,/^\[/p' fuzz/Cargo.toml | grep -v '^\[' | grep -v '^#' | grep -v '^$' || true)
  if [[ "$a" != "$b" ]]; then
    echo "fuzz: [profile.release] of fuzz/Cargo.toml differs from Cargo.toml's; copy it over" >&2
    exit 1
  fi
}

build() {
  need_cxx
  sync_lock
  check_profiles
  local log started
  log=$(mktemp)
  started=$(date +%s)
  if ! CARGO_TARGET_DIR=$target_dir RUSTC_WRAPPER=$root/scripts/fuzz-rustc.sh PDMESH_FUZZ_INSTRUMENT=1 \
    cargo build --release --manifest-path fuzz/Cargo.toml --features libfuzzer --bins 2>&1 | tee "$log" >&2; then
    rm -f "$log"
    exit 1
  fi
  local third
  third=$(grep -E '^\s+Compiling ' "$log" | awk '{print $2}' | grep -v '^pdmesh-' | tr '\n' ' ' || true)
  echo "fuzz: built in $(($(date +%s) - started)) s; third-party crates compiled: ${third:-none}"
  rm -f "$log"
}

bin() { echo "$target_dir/release/$1"; }

# The seeds a target writes for itself from real frames (fuzz/src/lib.rs).
seed() {
  rm -rf "$FUZZ_DIR/seeds/$1"
  PDMESH_FUZZ_SEEDS="$FUZZ_DIR/seeds/$1" "$(bin "$1")" 2>&1 | tail -1
}

# Fuzz one target for $2 seconds; prints one table row; returns non-zero on a crash or hang.
run_target() {
  local t=$1 secs=$2 log rc=0 started elapsed
  mkdir -p "$FUZZ_DIR/corpus/$t" "$FUZZ_DIR/artifacts/$t" "$FUZZ_DIR/logs"
  seed "$t" >/dev/null
  log="$FUZZ_DIR/logs/$t.log"
  started=$(date +%s)
  "$(bin "$t")" -max_total_time="$secs" -timeout="$FUZZ_INPUT_TIMEOUT_S" -rss_limit_mb=2048 -malloc_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$FUZZ_DIR/artifacts/$t/" \
    "$FUZZ_DIR/corpus/$t" "$FUZZ_DIR/seeds/$t" >"$log" 2>&1 || rc=$?
  elapsed=$(($(date +%s) - started))
  local execs done cov ft corp_n corp_kb crashes hangs
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{print $2}' | tail -1)
  done=$(grep -E '(DONE|pulse|NEW|REDUCE) +cov:' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$done")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$done")
  corp_n=$(find "$FUZZ_DIR/corpus/$t" -type f | wc -l)
  corp_kb=$(du -sk --apparent-size "$FUZZ_DIR/corpus/$t" | cut -f1)
  crashes=$(find "$FUZZ_DIR/artifacts/$t" -name 'crash-*' -o -name 'oom-*' -o -name 'leak-*' | wc -l)
  hangs=$(find "$FUZZ_DIR/artifacts/$t" -name 'timeout-*' | wc -l)
  printf '| %s | %s | %s s | %s | %s files, %s KiB | %s | %s | %s | %s |\n' "$t" "${execs:-?}" "$elapsed" \
    "$(( ${execs:-0} / (elapsed > 0 ? elapsed : 1) ))" "$corp_n" "$corp_kb" "${cov:-?}" "${ft:-?}" "$crashes" "$hangs"
  if [[ $rc -ne 0 || $crashes -ne 0 || $hangs -ne 0 ]]; then
    echo "fuzz: $t FAILED (exit $rc); the input is in $FUZZ_DIR/artifacts/$t/; log tail:" >&2
    tail -40 "$log" >&2
    return 1
  fi
}

# The campaign must fail on a crash and on a hang: a target given the selfcheck input
# (fuzz/src/lib.rs, SELFCHECK_INPUT) panics or spins, and each must be reported as such.
selfcheck() {
  local dir=$FUZZ_DIR/selfcheck mode rc kind
  for mode in panic hang; do
    rm -rf "$dir" && mkdir -p "$dir/in" "$dir/artifacts"
    printf 'pdmesh-fuzz-selfcheck' >"$dir/in/trigger"
    rc=0
    PDMESH_FUZZ_SELFCHECK=$mode "$(bin envelope)" -timeout=2 -runs=100 -artifact_prefix="$dir/artifacts/" \
      "$dir/in" >"$dir/$mode.log" 2>&1 || rc=$?
    kind=crash
    [[ $mode == hang ]] && kind=timeout
    if [[ $rc -eq 0 ]] || ! compgen -G "$dir/artifacts/$kind-*" >/dev/null; then
      echo "fuzz: selfcheck: a ${mode}ing input was not caught (exit $rc)" >&2
      tail -20 "$dir/$mode.log" >&2
      exit 1
    fi
  done
  rm -rf "$dir"
  echo "fuzz: selfcheck: a panicking and a hanging input both fail a run"
}

campaign() {
  local secs=$1 failed=0 started
  started=$(date +%s)
  build
  selfcheck
  echo "fuzz: ${#TARGETS[@]} targets, $secs s each, per-input limit ${FUZZ_INPUT_TIMEOUT_S} s, corpus in $FUZZ_DIR/corpus"
  echo "| target | inputs run | time | inputs/s | corpus | coverage (edges) | features | crashes | hangs |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for t in "${TARGETS[@]}"; do
    run_target "$t" "$secs" || failed=1
  done
  echo "fuzz: campaign took $(($(date +%s) - started)) s in all"
  return $failed
}

case "${1:-short}" in
  build) build ;;
  short) campaign "${FUZZ_SHORT_S:-20}" ;;
  long) campaign "${FUZZ_LONG_S:-600}" ;;
  run)
    build
    echo "| target | inputs run | time | inputs/s | corpus | coverage (edges) | features | crashes | hangs |"
    echo "|---|---|---|---|---|---|---|---|---|"
    run_target "${2:?target}" "${3:-60}"
    ;;
  repro)
    t=${2:?target}
    shift 2
    build
    "$(bin "$t")" -timeout="$FUZZ_INPUT_TIMEOUT_S" -rss_limit_mb=2048 -malloc_limit_mb=2048 "$@"
    ;;
  *)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
