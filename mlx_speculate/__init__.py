"""Lossless speculative decoding for local LLMs on MLX."""

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
