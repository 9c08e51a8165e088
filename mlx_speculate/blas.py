"""The BLAS that multiplies MLX's float32 matrices on a Linux CPU: the system's OpenBLAS when
it is installed, loaded before MLX is imported (importing `mlx_speculate` does it).

The `mlx[cpu]` wheel resolves its `cblas_*`/`sgemm_` calls in the process's global symbols
first, then in the reference BLAS it bundles, which is an order of magnitude slower: a library
loaded RTLD_GLOBAL before MLX (as `LD_PRELOAD` would) takes those calls. Once MLX is imported
its symbols are bound, so a later load would change nothing. macOS keeps Accelerate, which MLX
links itself. `MLX_SPECULATE_OPENBLAS=0` keeps the wheel's BLAS (a comparison, a crash report).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

VARIABLE = "MLX_SPECULATE_OPENBLAS"
_OFF = ("0", "false", "no", "off")

BLAS = "not chosen yet"  # what `load_openblas` found: `--verbose` and pytest's header say it


def candidates() -> Iterator[Path]:
    """Where OpenBLAS may be, most likely first: Debian/Ubuntu's multiarch folders (the
    pthread build, as `libopenblas0-pthread` installs it), Fedora's, then the loader's cache
    (asked last: it runs `ldconfig -p`)."""
    arch = f"{platform.machine()}-linux-gnu"
    yield Path(f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0")
    yield Path(f"/usr/lib/{arch}/libopenblas.so.0")
    yield Path("/usr/lib64/libopenblas.so.0")
    name = ctypes.util.find_library("openblas")
    if name is not None:
        yield Path(name)  # a soname the loader finds itself


def load_openblas() -> str:
    """Loads OpenBLAS (RTLD_GLOBAL) when on Linux, installed, wanted and MLX not yet imported;
    returns, and keeps in `BLAS`, which BLAS MLX's float32 matmuls run on."""
    global BLAS
    BLAS = _load()
    return BLAS


def _load() -> str:
    preloaded = os.environ.get("LD_PRELOAD", "")
    if "openblas" in preloaded:
        return f"OpenBLAS via LD_PRELOAD ({preloaded})"
    if platform.system() != "Linux":
        return "Accelerate" if platform.system() == "Darwin" else "the mlx wheel's"
    if os.environ.get(VARIABLE, "").strip().lower() in _OFF:
        return f"the mlx wheel's reference BLAS ({VARIABLE}={os.environ[VARIABLE]})"
    if "mlx.core" in sys.modules:
        return "the mlx wheel's (MLX was imported before mlx_speculate, too late to load OpenBLAS)"
    for path in candidates():
        if not path.is_absolute() or path.exists():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue  # another architecture's, a broken link: the next one, else the wheel's
            return f"OpenBLAS ({path})"
    return (
        "the mlx wheel's reference BLAS (no OpenBLAS found; on Debian/Ubuntu "
        "`apt install libopenblas0-pthread` makes float32 matmuls much faster)"
    )
