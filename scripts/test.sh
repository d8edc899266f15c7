#!/usr/bin/env bash
# Run every test of the workspace: unit, in-process integration, and process-level mesh
# tests. Release profile: the model tests need optimised code, and one profile means one build.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# The model tests need the GGUF file; fetch it (idempotent, verified by sha256).
if [[ "${PDMESH_SKIP_MODEL_TESTS:-0}" != "1" ]]; then
  export PDMESH_MODEL_PATH="${PDMESH_MODEL_PATH:-$(scripts/fetch-model.sh)}"
  # The other models users bring, into the same model directory: Qwen2.5-Coder-0.5B-Instruct and
  # Gemma 3 270M, both Q4_K_M (shared/model/tests/architectures.rs and tokenizer_models.rs,
  # services/pdmesh/tests/qwen_mesh.rs, the frontend's chat tests), and llama.cpp's tokenizer
  # vectors for the qwen2, llama-bpe and SentencePiece vocabularies (shared/model/tests/vocab_vectors.rs).
  export PDMESH_GEMMA3_PATH="${PDMESH_GEMMA3_PATH:-$(scripts/fetch-model.sh gemma3-270m)}"
  export PDMESH_QWEN25_PATH="${PDMESH_QWEN25_PATH:-$(scripts/fetch-model.sh qwen2.5-0.5b)}"
  export PDMESH_VOCAB_DIR="${PDMESH_VOCAB_DIR:-$(scripts/fetch-vocab-vectors.sh)}"
fi
# Formatting and lints hold by this check, not by discipline: rustfmt as configured, clippy with
# every warning an error (the workspace's deny lints included), every target.
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
# Every crate is on ARCHITECTURE.md's code map and README's layout (--selftest: a crate missing
# from either must be reported).
python3 scripts/check-code-map.py --selftest
# No import loop of more than two modules inside a service crate (issue 42); --selftest: a
# planted three-module loop must be reported.
python3 scripts/check-import-loops.py --selftest
# No non-test function over 100 lines outside the script's allowlist, each entry with its reason
# (issue 42); --selftest: a planted 101-line function must be reported, a 100-line one not.
python3 scripts/check-long-functions.py --selftest
cargo build --release --workspace --all-targets
# The GPU feature must build on every machine (CUDA is loaded at run time): the binary with
# the GPU executor and the cuda transfer backend, and the GPU tests, which run the model and the
# cuda backend between two processes where a GPU is present and say they skip elsewhere.
# Built workspace-wide so third-party crates keep the default build's features: only the crates
# with GPU code are compiled twice.
cargo build --release --workspace --all-targets --features pdmesh/cuda
cargo test --release --workspace --features pdmesh/cuda --test cuda --test cuda_ipc -- --nocapture
# The bundle a GPU machine without a toolchain runs (docs/BUILD.md) is made and unpacked here:
# each transfer fits, the model reassembles to its sha256, the binaries run from their package
# folders. Without a GPU the suite must then fail for that reason alone (the check refuses to
# skip), never for a broken bundle; with one it must pass.
if [[ "${PDMESH_SKIP_MODEL_TESTS:-0}" != "1" ]]; then
  scripts/gpu-bundle.sh >/dev/null
  gpu_dir=$(mktemp -d)
  GPU_CHECK_DIR=$gpu_dir scripts/gpu-check.sh stage >/dev/null
  if ! GPU_CHECK_DIR=$gpu_dir scripts/gpu-check.sh run executor >"$gpu_dir/check.log" 2>&1; then
    grep -q "PDMESH_REQUIRE_GPU=1, but" "$gpu_dir/check.log" || { cat "$gpu_dir/check.log"; exit 1; }
    echo "gpu-check bundle: unpacked and ran; its GPU tests refused to skip on this GPU-less machine"
  fi
  rm -rf "$gpu_dir" .gpu
fi
# Test binaries start whole meshes; two at a time is what a 2-core machine sustains.
cargo test --release --workspace -- --test-threads="${PDMESH_TEST_THREADS:-2}"
# Load-test smoke scenario (under 2 minutes): a synthetic P/D mesh under steady load, client
# disconnects and a rejection burst must end with no KV block held or used and no child dead.
# Reuses the release binaries built above; docs/LOADTEST.md.
PDMESH_BIN_DIR="${CARGO_TARGET_DIR:-target}/release" ./loadtest/scenarios/smoke.sh
# ... and its checks catch a broken figure: the smoke scenario with stranded blocks, blocks
# still held, hung requests, or a death left unrecovered must fail (about a minute).
PDMESH_BIN_DIR="${CARGO_TARGET_DIR:-target}/release" ./loadtest/scenarios/selfcheck.sh
# The Kubernetes manifests parse and their selectors, labels and ports agree; the scaled layout's
# router names headless Services of P and D pods that advertise their own address (D61).
# --selftest: each known breakage of the manifests must be reported.
python3 scripts/check-k8s.py --selftest
# The Grafana dashboard queries only metrics the code defines and docs/METRICS.md lists, with
# labels they carry; its provisioning points at files compose mounts (docs/METRICS.md, D48).
# --selftest: known-bad expressions must each be refused.
python3 scripts/check-dashboard.py --selftest
# pd-vs-colocated's verdict (issue #22, D79) reads past host bursts on either side's rounds and
# still sees a cost P/D pays in every round; checked on made-up rounds.
python3 loadtest/scenarios/pd_vs_colocated.py --selftest
# Coverage-guided fuzzing of every parser of outside bytes (envelope, side channel, tcp data
# plane, HTTP bodies), 20 s a target; fails on any crash or hang (docs/SECURITY.md). Reuses
# the release build above for every third-party crate.
./scripts/fuzz.sh short
# docker compose up of deploy/docker-compose.yml on this machine's engine (skipped, with the
# reason, when there is none); reuses the release binaries built above.
./scripts/compose-test.sh
# Prometheus (Debian's package; skipped, with the reason, when it is not installed) scrapes a
# running mesh with deploy/prometheus.yml's config: every target up, a pdmesh series queried
# through its HTTP API with the dashboard's labels.
PDMESH_BIN_DIR="${CARGO_TARGET_DIR:-target}/release" ./scripts/prometheus-test.sh
