"""HF folder, hub id or Llama GGUF -> mlx-lm folder: `python convert/convert.py --help`.

A thin wrapper: the converter is `mlx_speculate.convert` (also `python -m mlx_speculate.convert`).
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculate.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
