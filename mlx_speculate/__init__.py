"""Lossless speculative decoding for local LLMs on MLX."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Imported on first use, so that `python -m mlx_speculate.generate` (or .convert) does not find
# its own module already imported by the package.
_EXPORTS = {
    "GenerationResponse": "generate",
    "SpeculativeStats": "generate",
    "generate": "generate",
    "stream_generate": "generate",
    "load": "loading",
    "SamplingParams": "sampling",
}

if TYPE_CHECKING:
    from .generate import GenerationResponse, SpeculativeStats, generate, stream_generate
    from .loading import load
    from .sampling import SamplingParams

__all__ = [
    "GenerationResponse",
    "SamplingParams",
    "SpeculativeStats",
    "generate",
    "load",
    "stream_generate",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlx_speculate' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
