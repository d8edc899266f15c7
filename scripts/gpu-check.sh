#!/usr/bin/env bash
# Run the GPU checks of the cuda feature on a machine with an NVIDIA GPU, from what
# scripts/gpu-bundle.sh prepared (docs/BUILD.md, "Checking the GPU build on another machine").
# No Rust toolchain is needed here: the binaries were built elsewhere.
#
#   scripts/gpu-check.sh stage         with .gpu/a: unpack the binaries and keep the model's
#                                      first part in $GPU_CHECK_DIR (outside the repository)
#   scripts/gpu-check.sh run [SUITE…]  run the suites in order (default: executor ipc mesh
#                                      faults); the model is assembled from the staged part and
#                                      .gpu/b (sha256 checked) when a suite first needs it:
#       ipc       the cuda backend between two processes: data path, agent path, bandwidth
#                 (needs no model, so it can run right after `stage`)
#       executor  the GPU executor: resident cache = mirrored cache, tokens = the reference's
#       mesh      the real model through whole meshes on the GPU, the router's P/D output
#                 equal to colocated over the cuda backend (model_mesh.rs)
#       faults    every R3 fault on the cuda backend, under both policies (faults.rs)
#       bench     the agent path's test alone, for its bandwidth table (part of ipc)
# Each suite's output goes to stdout and, where $OUT is set, to $OUT/<suite>.log. Every suite
# runs; the exit status is non-zero when any failed. PDMESH_REQUIRE_GPU=1 makes a test that
# finds no GPU fail instead of skipping, so this check cannot pass without running.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
GPU_CHECK_DIR=${GPU_CHECK_DIR:-/tmp/pdmesh-gpu}
MODEL="$GPU_CHECK_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"

die() {
  echo "gpu-check: $*" >&2
  exit 2
}

stage() {
  [[ -f .gpu/a/bin.tar.xz && -f .gpu/a/model.part1 ]] || die ".gpu/a is not here (scripts/gpu-bundle.sh makes it)"
  mkdir -p "$GPU_CHECK_DIR"
  rm -rf "$GPU_CHECK_DIR/bin"
  # tar's xz filter, or Python's lzma where the machine has no xz
  if command -v xz >/dev/null; then
    tar -C "$GPU_CHECK_DIR" -xJf .gpu/a/bin.tar.xz || die "cannot unpack the binaries"
  else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' .gpu/a/bin.tar.xz "$GPU_CHECK_DIR" ||
      die "cannot unpack the binaries (no xz, and python3 could not either)"
  fi
  cp .gpu/a/model.part1 .gpu/a/model.sha256 .gpu/a/repo_path "$GPU_CHECK_DIR/" || die "cannot stage"
  echo "staged in $GPU_CHECK_DIR: $(wc -l <"$GPU_CHECK_DIR/bin/MANIFEST") test binaries, model part 1"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
}

# The model, assembled once from the staged part and .gpu/b, its sha256 checked.
model() {
  local want
  want=$(cat "$GPU_CHECK_DIR/model.sha256")
  if [[ -f "$MODEL" && "$(sha256sum "$MODEL" | cut -d' ' -f1)" == "$want" ]]; then
    return 0
  fi
  [[ -f .gpu/b/model.part2 ]] || die "the model's second part (.gpu/b) is not here"
  cat "$GPU_CHECK_DIR/model.part1" .gpu/b/model.part2 >"$MODEL"
  [[ "$(sha256sum "$MODEL" | cut -d' ' -f1)" == "$want" ]] || die "the assembled model's sha256 differs from the bundle's"
}

# Test binaries built elsewhere may hold that checkout's absolute paths (env!
# CARGO_MANIFEST_DIR): point the build checkout's path at this one where it is free.
link_build_path() {
  local built_at
  built_at=$(cat "$GPU_CHECK_DIR/repo_path" 2>/dev/null || true)
  if [[ -n "$built_at" && "$built_at" != "$REPO" && ! -e "$built_at" ]]; then
    mkdir -p "$(dirname "$built_at")" && ln -s "$REPO" "$built_at"
  fi
}

# run_test NAME [ARGS…]: run test binary NAME from its package folder, as cargo would.
run_test() {
  local name=$1 dir
  shift
  dir=$(awk -v n="$name" '$1 == n { print $2 }' "$GPU_CHECK_DIR/bin/MANIFEST")
  [[ -n "$dir" ]] || { echo "gpu-check: no test binary '$name' in the bundle" >&2; return 2; }
  (cd "$REPO/$dir" && "$GPU_CHECK_DIR/bin/$name" "$@")
}

suite() {
  case $1 in
    ipc) run_test cuda_ipc --nocapture --test-threads=1 ;;
    bench) run_test cuda_ipc --nocapture --exact cuda_backend_leases_reads_and_confirms_between_processes ;;
    executor) model && run_test cuda --nocapture --test-threads=1 ;;
    mesh | faults)
      local bin=$1
      [[ $bin == mesh ]] && bin=model_mesh
      # The qwen2 drills (Qwen2.5 over TP ranks) are not GPU tests: the CUDA executor runs the
      # llama recipe only and refuses qwen2 and tensor parallelism at start (docs/MODEL.md), and
      # their 491 MB model does not fit a transfer. scripts/test.sh runs them on the CPU.
      [[ $bin == faults ]] && echo "gpu-check: skipping the qwen2_* drills (CPU-only: the CUDA executor runs llama only)"
      model && PDMESH_MODEL_DEVICE=cuda PDMESH_KV_BACKEND=cuda PDMESH_TEST_BIN="$GPU_CHECK_DIR/bin/pdmesh" \
        run_test "$bin" --test-threads=1 --skip qwen2_
      ;;
    *) echo "gpu-check: unknown suite '$1'" >&2; return 2 ;;
  esac
}

case ${1:-} in
  stage) stage ;;
  run)
    shift
    [[ -f "$GPU_CHECK_DIR/bin/MANIFEST" ]] || die "nothing staged in $GPU_CHECK_DIR (run 'stage' with .gpu/a first)"
    link_build_path
    export PDMESH_REQUIRE_GPU=1 PDMESH_MODEL_PATH=$MODEL
    unset PDMESH_SKIP_MODEL_TESTS
    suites=("$@")
    ((${#suites[@]})) || suites=(executor ipc mesh faults)
    failed=()
    for s in "${suites[@]}"; do
      echo "=== $s"
      start=$(date +%s)
      if [[ -n "${OUT:-}" ]]; then
        (suite "$s") 2>&1 | tee "$OUT/$s.log"
      else
        (suite "$s") 2>&1
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
    sed -n '2,21p' "$0"
    exit 2
    ;;
esac
