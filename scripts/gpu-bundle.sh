#!/usr/bin/env bash
# Prepare a GPU check of the cuda feature for a machine that has an NVIDIA GPU but no Rust
# toolchain, no network and a cap on what can be copied to it per transfer (docs/BUILD.md,
# "Checking the GPU build on another machine").
#
# Builds here, with the cuda feature, the pdmesh binary and the test binaries that exercise
# the GPU (`cuda`: the executor; `cuda_ipc`: the cuda transfer backend between two processes;
# `model_mesh` and `faults`: the real model through whole meshes on the GPU, cuda backend),
# and splits them and the model into two folders, each of which fits one transfer of
# LIMIT_MIB (64) together with the repository:
#   .gpu/a   the binaries (bin.tar.xz, stripped; bin/MANIFEST names each test binary and the
#            package folder it runs from), the model's sha256, and as much of the model as fits
#   .gpu/b   the rest of the model
# On the GPU machine, with the repository copied there:
#   scripts/gpu-check.sh stage && scripts/gpu-check.sh run ipc   (with .gpu/a; needs no model)
#   scripts/gpu-check.sh run                                     (with .gpu/b; the rest)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
LIMIT_MIB=${LIMIT_MIB:-64}
MARGIN_KIB=2048

MODEL="${PDMESH_MODEL_PATH:-$(scripts/fetch-model.sh)}"
OUT=.gpu
rm -rf "$OUT"
mkdir -p "$OUT/a" "$OUT/b" "$OUT/stage/bin"

TESTS=(cuda cuda_ipc model_mesh faults)
args=()
for t in "${TESTS[@]}"; do args+=(--test "$t"); done
# The binary and the tests with the same features (scripts/test.sh built them already).
cargo build --release --workspace --features pdmesh/cuda --bins --message-format=json >"$OUT/build.json"
cargo test --release --workspace --features pdmesh/cuda --no-run "${args[@]}" --message-format=json >"$OUT/tests.json"

python3 - "$OUT" <<'EOF'
import json, shutil, sys, os
out = sys.argv[1]
manifest = []
def artifacts(path):
    for line in open(path):
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") == "compiler-artifact" and m.get("executable"):
            yield m
for m in artifacts(f"{out}/build.json"):
    if m["target"]["name"] == "pdmesh" and "bin" in m["target"]["kind"]:
        shutil.copy(m["executable"], f"{out}/stage/bin/pdmesh")
for m in artifacts(f"{out}/tests.json"):
    if "test" in m["target"]["kind"]:
        name = m["target"]["name"]
        # the package folder, relative to the repository: cargo runs a test binary there
        pkg_dir = os.path.relpath(os.path.dirname(m["manifest_path"]))
        shutil.copy(m["executable"], f"{out}/stage/bin/{name}")
        manifest.append(f"{name} {pkg_dir}")
if not os.path.exists(f"{out}/stage/bin/pdmesh"):
    sys.exit("gpu-bundle: the pdmesh binary was not among the build's artifacts")
if len(manifest) != 4:
    sys.exit(f"gpu-bundle: expected 4 test binaries, found {manifest}")
open(f"{out}/stage/bin/MANIFEST", "w").write("\n".join(sorted(manifest)) + "\n")
EOF
strip "$OUT"/stage/bin/* 2>/dev/null || true
# xz: the stripped binaries take 9 MB instead of gzip's 24, room the model's parts need
tar -C "$OUT/stage" -cf - bin | xz -9 -T2 >"$OUT/a/bin.tar.xz"
sha256sum "$MODEL" | cut -d' ' -f1 >"$OUT/a/model.sha256"
pwd >"$OUT/a/repo_path"
rm -rf "$OUT/stage" "$OUT/build.json" "$OUT/tests.json"

# What travels besides each folder is the repository itself (tracked and unignored files).
tree_kib=$(git ls-files -co --exclude-standard -z | du -c --files0-from=- -k 2>/dev/null | tail -1 | cut -f1)
room_kib=$((LIMIT_MIB * 1024 - tree_kib - MARGIN_KIB - $(du -sk "$OUT/a" | cut -f1)))
if ((room_kib <= 0)); then
  echo "gpu-bundle: the binaries and the repository leave no room in a ${LIMIT_MIB} MiB transfer" >&2
  exit 1
fi
head -c "$((room_kib * 1024))" "$MODEL" >"$OUT/a/model.part1"
tail -c "+$((room_kib * 1024 + 1))" "$MODEL" >"$OUT/b/model.part2"
for part in a b; do
  kib=$(($(du -sk "$OUT/$part" | cut -f1) + tree_kib))
  echo "transfer $part: .gpu/$part and the repository, $((kib / 1024)) MiB" >&2
  if ((kib > LIMIT_MIB * 1024)); then
    echo "gpu-bundle: transfer $part exceeds ${LIMIT_MIB} MiB" >&2
    exit 1
  fi
done
echo "$OUT"
