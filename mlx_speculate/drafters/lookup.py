"""Prompt lookup: draft by copying what followed the last n tokens the last time they occurred."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from . import Draft, TargetState


class LookupDrafter:
    """N-gram drafter with no model: for n from `max_ngram` down to 1, find the most recent
    earlier occurrence of the context's last n tokens and propose what followed it.

    Proposals are deterministic, so their rows are one-hot and rejection sampling accepts each
    with the target's p(x): still lossless. An index from every n-gram to the end of its most
    recent occurrence grows with the context, so a step only indexes the tokens new since the
    last one.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, max_ngram: int = 3, max_k: int = 10):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.max_k = max_k
        self._reset()

    def _reset(self) -> None:
        # _last[n - 1][ngram] = e: the latest occurrence of the n-gram is context[e - n : e].
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram)]
        self._indexed = 0  # every end e <= _indexed is in the index

    def match(self, context: Sequence[int]) -> int | None:
        """Where the continuation of the most recent earlier match of the longest suffix starts."""
        length = len(context)
        if length - 1 < self._indexed:
            self._reset()
        # Ends up to length - 1 only: the suffix itself (ending at length) is not an earlier match.
        for end in range(self._indexed + 1, length):
            for n in range(1, min(self.max_ngram, end) + 1):
                self._last[n - 1][tuple(context[end - n : end])] = end
        self._indexed = max(self._indexed, length - 1)
        for n in range(min(self.max_ngram, length), 0, -1):
            end = self._last[n - 1].get(tuple(context[length - n :]))
            if end is not None:
                return end
        return None

    def propose(self, context: Sequence[int], k: int, state: TargetState | None) -> Draft | None:
        k = min(k, self.max_k)
        start = self.match(context) if k > 0 else None
        if start is None:
            return None
        tokens: list[int] = []
        for i in range(start, start + k):
            # A match overlapping the suffix continues with its own proposal (periodic text).
            tokens.append(context[i] if i < len(context) else tokens[i - len(context)])
        drafted = mx.array(tokens, dtype=mx.int32)  # (k,)
        logprobs = mx.where(mx.arange(self.vocab_size) == drafted[:, None], 0.0, -mx.inf)
        return Draft(drafted, logprobs)  # logprobs: (k, V) one-hot

    def rewind(self, length: int) -> None:
        if length < self._indexed:
            self._reset()
