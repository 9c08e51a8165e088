"""Lossless speculative decoding for local LLMs on MLX."""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import TYPE_CHECKING

from . import blas

# Before any module imports MLX: its float32 matmuls then run on the system's OpenBLAS.
blas.load_openblas()
# transformers imported without torch (a plain install: this package reads only its tokenizers)
# advises on stderr that its models are unavailable, which is not the user's concern here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Imported on first use, so that `python -m mlx_speculate.convert` does not pay for them.
_EXPORTS = {
    "GenerationResponse": "generation",
    "Session": "generation",
    "SpeculativeStats": "generation",
    "generate": "generation",
    "stream_generate": "generation",
    "load": "loading",
    "make_drafter": "drafters",
    "SamplingParams": "sampling",
}

if TYPE_CHECKING:
    from .drafters import make_drafter
    from .generation import (
        GenerationResponse,
        Session,
        SpeculativeStats,
        generate,
        stream_generate,
    )
    from .loading import load
    from .sampling import SamplingParams

__all__ = [
    "GenerationResponse",
    "SamplingParams",
    "Session",
    "SpeculativeStats",
    "generate",
    "load",
    "make_drafter",
    "stream_generate",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlx_speculate' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the CLI module `mlx_speculate.generate` would bind it over the function of
        # that name: the exported names always stay the documented objects.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
