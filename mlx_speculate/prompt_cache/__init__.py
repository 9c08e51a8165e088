"""Prompt-cache files: a long prompt prefilled once (`python -m mlx_speculate.cache_prompt`),
saved atomically, and generation started from it later (`generate --prompt-cache-file`,
`stream_generate(..., prompt_cache_file=)`) prefilling only what follows it. mlx-lm's names and
file layout (file.py); docs/long-context.md."""

from .file import PromptCache, load_prompt_cache, read_metadata, save_prompt_cache
from .prefill import cache_prompt, resume

__all__ = [
    "PromptCache",
    "cache_prompt",
    "load_prompt_cache",
    "read_metadata",
    "resume",
    "save_prompt_cache",
]
