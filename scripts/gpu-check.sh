#!/usr/bin/env bash
# Run the GPU checks of the cuda feature on a machine with an NVIDIA GPU, from what
# scripts/gpu-bundle.sh prepared (docs/BUILD.md, "Checking the GPU build on another machine").
# No Rust toolchain is needed here: the binaries were built elsewhere.
#
#   scripts/gpu-check.sh stage        keep .gpu/a's model part in $GPU_CHECK_DIR
#   scripts/gpu-check.sh run [SUITE…] assemble the model (sha256 checked), unpack the binaries
#                                     and run the suites, in order (default: all of them):
#       executor  the GPU executor: resident cache = mirrored cache, tokens = the CPU's
#       ipc       the cuda backend between two processes: data path, agent path, bandwidth
#       mesh      the real model through whole meshes on the GPU, the router's P/D output
#                 equal to colocated over the cuda backend (model_mesh.rs)
#       faults    every R3 fault on the cuda backend, under both policies (faults.rs)
#       bench     the agent path's bandwidth alone (part of ipc; printed, not asserted)
# Each suite's output goes to stdout and, where $OUT is set, to $OUT/<suite>.log. Exits non-zero
# when any suite failed; every suite runs regardless. PDMESH_REQUIRE_GPU=1 makes a test that
# finds no GPU fail instead of skipping, so this check cannot pass without running.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
GPU_CHECK_DIR=${GPU_CHECK_DIR:-/tmp/pdmesh-gpu}
mkdir -p "$GPU_CHECK_DIR"

stage() {
  [[ -f .gpu/a/model.part1 ]] || { echo "gpu-check: .gpu/a/model.part1 is not here" >&2; exit 2; }
  cp .gpu/a/model.part1 "$GPU_CHECK_DIR/model.part1"
  echo "staged model part 1 ($(du -h "$GPU_CHECK_DIR/model.part1" | cut -f1)) in $GPU_CHECK_DIR"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
}

prepare() {
  local model="$GPU_CHECK_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [[ ! -f "$model" ]] || [[ "$(sha256sum "$model" | cut -d' ' -f1)" != "$(cat .gpu/b/model.sha256)" ]]; then
    [[ -f "$GPU_CHECK_DIR/model.part1" ]] || {
      echo "gpu-check: model part 1 is not staged in $GPU_CHECK_DIR (run 'stage' first, on this machine)" >&2
      exit 2
    }
    cat "$GPU_CHECK_DIR/model.part1" .gpu/b/model.part2 >"$model"
    if [[ "$(sha256sum "$model" | cut -d' ' -f1)" != "$(cat .gpu/b/model.sha256)" ]]; then
      echo "gpu-check: the assembled model's sha256 differs from the bundle's" >&2
      exit 2
    fi
  fi
  export PDMESH_MODEL_PATH=$model
  rm -rf "$GPU_CHECK_DIR/bin"
  tar -C "$GPU_CHECK_DIR" -xzf .gpu/b/bin.tar.gz
  # Test binaries built elsewhere may hold that checkout's absolute paths (env!
  # CARGO_MANIFEST_DIR): point the build checkout's path at this one where it is free.
  local built_at
  built_at=$(cat .gpu/b/repo_path 2>/dev/null || true)
  if [[ -n "$built_at" && "$built_at" != "$REPO" && ! -e "$built_at" ]]; then
    mkdir -p "$(dirname "$built_at")" && ln -s "$REPO" "$built_at"
  fi
}

# run_test NAME [ARGS…]: run test binary NAME from its package folder, as cargo would.
run_test() {
  local name=$1
  shift
  local dir
  dir=$(awk -v n="$name" '$1 == n { print $2 }' "$GPU_CHECK_DIR/bin/MANIFEST")
  [[ -n "$dir" ]] || { echo "gpu-check: no test binary '$name' in the bundle" >&2; return 2; }
  (cd "$REPO/$dir" && "$GPU_CHECK_DIR/bin/$name" "$@")
}

suite() {
  case $1 in
    executor) run_test cuda --nocapture --test-threads=1 ;;
    ipc) run_test cuda_ipc --nocapture --test-threads=1 ;;
    bench) run_test cuda_ipc --nocapture --exact cuda_backend_leases_reads_and_confirms_between_processes ;;
    mesh | faults)
      local bin=$1
      [[ $bin == mesh ]] && bin=model_mesh
      PDMESH_MODEL_DEVICE=cuda PDMESH_KV_BACKEND=cuda PDMESH_TEST_BIN="$GPU_CHECK_DIR/bin/pdmesh" \
        run_test "$bin" --test-threads=1
      ;;
    *) echo "gpu-check: unknown suite '$1'" >&2; return 2 ;;
  esac
}

case ${1:-} in
  stage) stage ;;
  run)
    shift
    prepare
    export PDMESH_REQUIRE_GPU=1
    unset PDMESH_SKIP_MODEL_TESTS
    suites=("$@")
    ((${#suites[@]})) || suites=(executor ipc mesh faults)
    failed=()
    for s in "${suites[@]}"; do
      echo "=== $s"
      start=$(date +%s)
      if [[ -n "${OUT:-}" ]]; then
        suite "$s" 2>&1 | tee "$OUT/$s.log"
      else
        suite "$s" 2>&1
      fi
      rc=${PIPESTATUS[0]}
      echo "=== $s: exit $rc in $(($(date +%s) - start)) s"
      ((rc == 0)) || failed+=("$s")
    done
    if ((${#failed[@]})); then
      echo "FAILED: ${failed[*]}"
      exit 1
    fi
    echo "ALL PASSED: ${suites[*]}"
    ;;
  *)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
