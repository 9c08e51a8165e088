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
    keywords: ClassVar[dict[str, str | None]] = {
        "prompt_lookup": None,
        "max_ngram": "max_ngram",
        "lookup_branches": "branches",
    }
    flags: ClassVar[dict[str, str]] = {
        "prompt_lookup": "--prompt-lookup",
        "max_ngram": "--max-ngram",
        "lookup_branches": "--lookup-branches",
    }

    max_ngram: int = 3
    branches: int = 1  # matches verified together as one tree (1: a chain)

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
        group.add_argument(
            "--lookup-branches",
            type=positive_int,
            default=None,
            metavar="B",
            help="prompt lookup: verify up to B matches together as one tree (default: 1)",
        )

    @classmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {
            "prompt_lookup": args.prompt_lookup,
            "max_ngram": args.max_ngram,
            "lookup_branches": args.lookup_branches,
        }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_ngram < 1:
            raise ValueError(f"the longest n-gram must be >= 1, got {self.max_ngram}")
        if self.branches < 1:
            raise ValueError(f"lookup_branches must be >= 1, got {self.branches}")

    def build(self, target: CausalLM, tokenizer=None) -> LookupDrafter:
        most = self.num_draft_tokens or MAX_DRAFT * self.branches  # a chain's worth per branch
        return LookupDrafter(self.max_ngram, most, self.branches)


class LookupDrafter:
    """N-gram drafter with no model: for n from `max_ngram` down to 1, find the most recent
    earlier occurrence of the context's last n tokens and propose what followed it.

    With `branches` > 1 it proposes a tree (as SuffixDecoding does): the continuations of up to
    that many matches (longest match first, then the most recent), merged where they share a
    prefix. The k nodes are shared out by match length: a match of n tokens among m drafts up
    to k * n / (max_ngram * m) tokens, since a longer match is likelier to run on.

    Proposals are deterministic picks (no draft distribution), so (tree) rejection sampling
    accepts each with the target's p(x): still lossless. An index from every n-gram to the
    ends of its most recent occurrences grows with the context, so a step only indexes the
    tokens new since the last one, and a lookup costs the same on any context length.
    """

    taps: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, max_draft: int = MAX_DRAFT, branches: int = 1):
        if max_ngram < 1:
            raise ValueError(f"the longest n-gram must be >= 1, got {max_ngram}")
        if max_draft < 1:
            raise ValueError(f"the number of draft tokens must be >= 1, got {max_draft}")
        if branches < 1:
            raise ValueError(f"lookup branches must be >= 1, got {branches}")
        self.max_ngram = max_ngram
        self.max_draft = max_draft
        self.branches = branches
        self._reset()

    def _reset(self) -> None:
        # _ends[n - 1][ngram]: ends e of its latest occurrences, latest first (at most
        # `branches`), each with context[e - n : e] == ngram.
        self._ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(self.max_ngram)]
        self._indexed = 0  # every end e <= _indexed is in the index

    def matches(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(n, start of the continuation) of earlier occurrences of the context's suffixes:
        longest first, then latest; at most `branches`."""
        length = len(context)
        if length - 1 < self._indexed:
            self._reset()
        # Ends up to length - 1 only: the suffix itself (ending at length) is not an earlier match.
        for end in range(self._indexed + 1, length):
            for n in range(1, min(self.max_ngram, end) + 1):
                ends = self._ends[n - 1].setdefault(tuple(context[end - n : end]), [])
                ends.insert(0, end)
                del ends[self.branches :]
        self._indexed = max(self._indexed, length - 1)
        found: list[tuple[int, int]] = []
        for n in range(min(self.max_ngram, length), 0, -1):
            for end in self._ends[n - 1].get(tuple(context[length - n :]), ()):
                if all(end != e for _, e in found):
                    found.append((n, end))
        return found[: self.branches]

    def match(self, context: Sequence[int]) -> int | None:
        """Where the continuation of the most recent earlier match of the longest suffix starts."""
        found = self.matches(context)
        return found[0][1] if found else None

    def extend(self, features: TargetFeatures) -> None:
        pass  # it reads tokens, not the target's features

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        k = min(k, self.max_draft)
        found = self.matches(context) if k > 0 else []
        if not found:
            return None
        parents, tokens = [-1], []
        node: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for n, start in found:
            length = k if len(found) == 1 else -(-k * n // (self.max_ngram * len(found)))
            parent, run = 0, []
            for j in range(start, start + length):
                # A match overlapping the suffix continues with its own proposal (periodic text).
                token = context[j] if j < len(context) else run[j - len(context)]
                run.append(token)
                if (parent, token) not in node:
                    if len(tokens) == k:
                        break
                    node[parent, token] = len(parents)
                    parents.append(parent)
                    tokens.append(token)
                parent = node[parent, token]
        tree = Tree.chain(k) if len(found) == 1 else Tree(tuple(parents))
        return Draft(mx.array(tokens, dtype=mx.int32), tree)

    def rewind(self, length: int) -> None:
        if length < self._indexed:
            self._reset()
