"""Debian's OpenBLAS for the test process, loaded before anything imports MLX (conftest.py
imports this module first), as `.ci/run`'s LD_PRELOAD does: the `mlx[cpu]` wheel multiplies
float32 matrices with reference BLAS (~2 GFLOP/s here), which made a real-weight SmolLM2
structured-output schema take 720 s. Absent OpenBLAS (or off Linux) nothing changes;
pytest's header says which BLAS ran."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")


def load_openblas() -> str:
    """Loads OpenBLAS when it is there and MLX is not yet imported; says which BLAS runs."""
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return f"OpenBLAS via LD_PRELOAD ({os.environ['LD_PRELOAD']})"
    if platform.system() != "Linux":
        return f"the platform's ({platform.system()})"
    if "mlx.core" in sys.modules:
        return "the mlx wheel's (MLX was imported before tests/blas.py)"
    if not OPENBLAS.exists():
        return f"the mlx wheel's reference BLAS ({OPENBLAS} is absent)"
    ctypes.CDLL(str(OPENBLAS), mode=ctypes.RTLD_GLOBAL)
    return f"OpenBLAS ({OPENBLAS})"


BLAS = load_openblas()
