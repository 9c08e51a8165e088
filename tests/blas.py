"""Which BLAS the test process runs on: importing `mlx_speculate` loads Debian's OpenBLAS
before anything imports MLX (`mlx_speculate/blas.py`; conftest.py imports this module first),
as a user's process does (the `mlx[cpu]` wheel's reference BLAS would make the real-weight
tests many times slower). `MLX_SPECULATE_OPENBLAS=0` runs the suite on the wheel's BLAS;
pytest's header says which BLAS ran."""

from __future__ import annotations

from mlx_speculate import blas

BLAS = blas.BLAS
