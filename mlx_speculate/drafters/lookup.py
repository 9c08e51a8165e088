"""Prompt lookup: draft by copying what followed the last n tokens the last time they occurred."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx

from ..cli import positive_int
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..tree import Tree
from .base import MAX_DRAFT, Draft, DrafterSpec, TargetFeatures


@dataclass(frozen=True, kw_only=True, eq=False)
class LookupSpec(DrafterSpec):
    """Prompt lookup: drafts copied from earlier n-grams (up to `max_ngram` tokens) of the
    prompt and output. Needs no model, so it fits every target."""

    method: ClassVar[str] = "prompt_lookup"  # the keyword's name, as in `prompt_lookup=True`
    keywords: ClassVar[dict[str, str | None]] = {"prompt_lookup": None, "max_ngram": "max_ngram"}
    flags: ClassVar[dict[str, str]] = {
        "prompt_lookup": "--prompt-lookup",
        "max_ngram": "--max-ngram",
    }

    max_ngram: int = 3

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--prompt-lookup",
            action="store_true",
            help="draft by n-gram lookup in the prompt and output (no model needed)",
        )
        group.add_argument(
            "--max-ngram",
            type=positive_int,
            default=None,
            metavar="N",
            help="longest n-gram prompt lookup matches (default: 3)",
        )

    @classmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"prompt_lookup": args.prompt_lookup, "max_ngram": args.max_ngram}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_ngram < 1:
            raise ValueError(f"the longest n-gram must be >= 1, got {self.max_ngram}")

    def build(self, target: CausalLM, tokenizer=None) -> LookupDrafter:
        return LookupDrafter(self.max_ngram, self.num_draft_tokens or MAX_DRAFT)


class LookupDrafter:
    """N-gram drafter with no model: for n from `max_ngram` down to 1, find the most recent
    earlier occurrence of the context's last n tokens and propose what followed it.

    Proposals are deterministic picks (no draft distribution), so rejection sampling accepts
    each with the target's p(x): still lossless. An index from every n-gram to the end of its
    most recent occurrence grows with the context, so a step only indexes the tokens new since
    the last one.
    """

    taps: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, max_draft: int = MAX_DRAFT):
        if max_ngram < 1:
            raise ValueError(f"the longest n-gram must be >= 1, got {max_ngram}")
        if max_draft < 1:
            raise ValueError(f"the number of draft tokens must be >= 1, got {max_draft}")
        self.max_ngram = max_ngram
        self.max_draft = max_draft
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

    def extend(self, features: TargetFeatures) -> None:
        pass  # it reads tokens, not the target's features

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        k = min(k, self.max_draft)
        start = self.match(context) if k > 0 else None
        if start is None:
            return None
        tokens: list[int] = []
        for i in range(start, start + k):
            # A match overlapping the suffix continues with its own proposal (periodic text).
            tokens.append(context[i] if i < len(context) else tokens[i - len(context)])
        return Draft(mx.array(tokens, dtype=mx.int32), Tree.chain(k))

    def rewind(self, length: int) -> None:
        if length < self._indexed:
            self._reset()
