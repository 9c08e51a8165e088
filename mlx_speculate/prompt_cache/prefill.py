"""A prompt's cache made once and started from later: prefill a prompt into a `PromptCache`,
and start a sequence from a prompt-cache file with a prompt that continues the cached one."""

from __future__ import annotations

from collections import abc
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..models.base import CausalLM
from ..sequence import Sequence
from ..state_cache import HybridCache
from .file import PromptCache, load_prompt_cache


def cache_prompt(
    model: CausalLM,
    tokens: abc.Sequence[int],
    *,
    name: str = "",
    cancelled: Callable[[], bool] | None = None,
) -> PromptCache:
    """The cache of `tokens` after their prefill (prefill.py's chunks; `cancelled` as there).
    The last token runs in a forward of its own, so that a hybrid's recurrent state is kept
    both before and after it: the cached prompt sent again as a whole re-runs that token alone
    (the prefix reuse keeps all but a prompt's last token: sequence.py), on a hybrid too.
    `name`: what the model was loaded from."""
    sequence = Sequence(model)
    cache = sequence.cache
    if len(tokens) > 1:
        sequence.prefill(tokens[:-1], cancelled)
    before = (
        list(zip(cache.conv, cache.ring, strict=True)) if isinstance(cache, HybridCache) else []
    )
    sequence.prefill(tokens, cancelled)
    if before and len(tokens) > 1:
        # A prompt's forward keeps its final state alone: the ring of the last token's
        # forward is joined by hand from the state entering it.
        for r, (window, state) in enumerate(before):
            cache.conv[r] = mx.concatenate([window, cache.conv[r][:, -1:]], axis=1)
            cache.ring[r] = mx.concatenate([state, cache.ring[r]])
        cache.as_after(len(tokens) - 1, 1, len(tokens))
    return PromptCache(tuple(sequence.context), cache, name)


def resume(
    sequence: Sequence, path: str | Path, prompt: str | abc.Sequence[int], tokenizer
) -> list[int]:
    """Starts `sequence` from the prompt-cache file `path` (`Sequence.resume`) and returns the
    whole prompt to prefill: the cached tokens, then `prompt`'s, as mlx-lm's `prompt_cache`
    continues its cache (text is encoded without special tokens: no second BOS). Only the
    continuation is prefilled; an empty one re-runs the cached prompt's last token."""
    loaded = load_prompt_cache(path, sequence.model)
    sequence.resume(loaded.tokens, loaded.cache)
    if isinstance(prompt, str):
        continued = list(tokenizer.encode(prompt, add_special_tokens=False)) if prompt else []
    else:
        continued = list(prompt)
    return [*loaded.tokens, *continued]
