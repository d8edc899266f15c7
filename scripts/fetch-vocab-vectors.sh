#!/usr/bin/env bash
# Fetch llama.cpp's tokenizer test vectors: vocabulary-only GGUF files with the texts
# (`.gguf.inp`) and the ids llama.cpp's tokenizer gives them (`.gguf.out`; format: llama.cpp's
# tests/test-tokenizer-0.cpp). They ship in the llama-cpp-python source distribution (its
# vendored llama.cpp), so `pip download` (pip's own configured index) is the only network
# access; the registry is not named here. Version and hashes are pinned; a mismatch is an error.
#
# Usage: scripts/fetch-vocab-vectors.sh [DIR]
#   DIR defaults to $PDMESH_VOCAB_DIR, else $HOME/.cache/pdmesh/vocab.
# Idempotent: files already there with the right sha256 are not fetched again.
# Prints the absolute path of the directory on stdout (everything else goes to stderr).
# shared/model/tests/vocab_vectors.rs reads it from PDMESH_VOCAB_DIR (scripts/test.sh sets it).
set -euo pipefail

SDIST_VERSION=0.3.36
SDIST_FILE="llama_cpp_python-${SDIST_VERSION}.tar.gz"
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# file (under vendor/llama.cpp/models/) | sha256
FILES=(
  "ggml-vocab-qwen2.gguf|44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c"
  "ggml-vocab-qwen2.gguf.inp|be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0"
  "ggml-vocab-qwen2.gguf.out|de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363"
  "ggml-vocab-llama-bpe.gguf|97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e"
  "ggml-vocab-llama-bpe.gguf.inp|be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0"
  "ggml-vocab-llama-bpe.gguf.out|118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b"
  "ggml-vocab-llama-spm.gguf|16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69"
  "ggml-vocab-llama-spm.gguf.inp|be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0"
  "ggml-vocab-llama-spm.gguf.out|ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29"
)

DIR="${1:-${PDMESH_VOCAB_DIR:-$HOME/.cache/pdmesh/vocab}}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

all_present() {
  local entry name sha
  for entry in "${FILES[@]}"; do
    IFS='|' read -r name sha <<<"$entry"
    [[ -f "$DIR/$name" && "$(sha_of "$DIR/$name")" == "$sha" ]] || return 1
  done
}

if all_present; then
  echo "tokenizer vectors already present: $DIR" >&2
  echo "$DIR"
  exit 0
fi

for tool in tar sha256sum; do
  command -v "$tool" >/dev/null 2>&1 || { echo "fetch-vocab-vectors: '$tool' is required" >&2; exit 1; }
done
if command -v pip >/dev/null 2>&1; then PIP=(pip); else PIP=(python3 -m pip); fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "downloading the llama-cpp-python ${SDIST_VERSION} source distribution ..." >&2
# --no-deps: only this package; pip still prepares its metadata (fetching its build backend)
"${PIP[@]}" download --no-deps --quiet "llama-cpp-python==${SDIST_VERSION}" -d "$TMP" >&2
if [[ ! -f "$TMP/$SDIST_FILE" ]]; then
  echo "fetch-vocab-vectors: pip did not produce $SDIST_FILE" >&2
  exit 1
fi
got="$(sha_of "$TMP/$SDIST_FILE")"
if [[ "$got" != "$SDIST_SHA256" ]]; then
  echo "fetch-vocab-vectors: $SDIST_FILE has sha256 $got, expected $SDIST_SHA256" >&2
  exit 1
fi
members=()
for entry in "${FILES[@]}"; do
  members+=("llama_cpp_python-${SDIST_VERSION}/vendor/llama.cpp/models/${entry%%|*}")
done
tar -xzf "$TMP/$SDIST_FILE" -C "$TMP" "${members[@]}"
for entry in "${FILES[@]}"; do
  IFS='|' read -r name sha <<<"$entry"
  src="$TMP/llama_cpp_python-${SDIST_VERSION}/vendor/llama.cpp/models/$name"
  got="$(sha_of "$src")"
  if [[ "$got" != "$sha" ]]; then
    echo "fetch-vocab-vectors: $name has sha256 $got, expected $sha" >&2
    exit 1
  fi
  mv "$src" "$DIR/$name"
done
echo "tokenizer vectors in $DIR" >&2
echo "$DIR"
