"""Prompt lookup: draft by copying what followed the last n tokens the last time they occurred."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..cli import positive_int
from ..models import needs_native
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..tree import Tree
from .base import MAX_DRAFT, Draft, Drafter, DrafterSpec, TargetFeatures

BRANCHES = 3  # matches a lookup tree holds: a tree's tau is never below its best chain's


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
    logits_only: ClassVar[bool] = True

    max_ngram: int = 3
    # Matches verified together as one tree (1: a chain); by default BRANCHES, or 1 for a
    # target that verifies chains only (`CausalLM.verifies_trees`).
    branches: int | None = None

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
            help=f"prompt lookup: verify up to B matches together as one tree (default: "
            f"{BRANCHES}; 1 drafts a chain)",
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
        if self.branches is not None and self.branches < 1:
            raise ValueError(f"lookup_branches must be >= 1, got {self.branches}")

    def build(self, target: CausalLM, tokenizer=None) -> LookupDrafter:
        branches = self.branches or (BRANCHES if target.verifies_trees else 1)
        if branches > 1 and target.implementation != "native":
            what = "prompt lookup with lookup_branches > 1"
            raise ValueError(needs_native(what, target.args.model_type))
        most = self.num_draft_tokens or MAX_DRAFT * branches  # a chain's worth per branch
        return LookupDrafter(self.max_ngram, most, branches)


MAX_MATCH = 64  # tokens a match is measured back over: its length ranks it
KEEP = 8  # latest occurrences of each n-gram kept as candidate matches


class LookupDrafter(Drafter):
    """N-gram drafter with no model, after SuffixDecoding: the latest `KEEP` earlier
    occurrences of the context's last n tokens (n up to `max_ngram`) are candidate matches,
    each measured back to its full length (up to `MAX_MATCH`); the longest (then latest) one
    is copied, and with `branches` > 1 that many are verified together as one tree, merged
    where their continuations agree.

    The match length sets the draft: a continuation at depth d of a match of length L is
    scored (L + 1) / (L + d + 2), the chance that a copy which held for L tokens holds d + 1
    more (the rule of succession), weighted by L^2 among the matches (a longer match is
    likelier the one being copied); a proposal of k keeps the k best nodes, which include
    their parents (a node never scores above its parent), so the tree of k nodes is the best
    prefix of the one of k + 1.

    Proposals are deterministic picks (no draft distribution), so (tree) rejection sampling
    accepts each with the target's p(x): still lossless. The index from every n-gram to its
    latest ends grows with the context, so a step only indexes the tokens new since the last
    one, and a lookup costs the same on any context length.
    """

    taps: tuple[int, ...] = ()

    follows_context = True

    def __init__(
        self, max_ngram: int = 3, max_draft: int = MAX_DRAFT * BRANCHES, branches: int = BRANCHES
    ):
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

    def weights(self) -> tuple[nn.Module, ...]:
        return ()

    def _reset(self) -> None:
        # _ends[n - 1][ngram]: ends e of its latest occurrences, latest first (at most KEEP),
        # each with context[e - n : e] == ngram.
        self._ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(self.max_ngram)]
        self._indexed = 0  # every end e <= _indexed is in the index

    def matches(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(match length, start of the continuation) of earlier occurrences of the context's
        suffixes: longest first, then latest; at most `branches`."""
        length = len(context)
        if length - 1 < self._indexed:
            self._reset()
        # Ends up to length - 1 only: the suffix itself (ending at length) is not an earlier match.
        for end in range(self._indexed + 1, length):
            for n in range(1, min(self.max_ngram, end) + 1):
                ends = self._ends[n - 1].setdefault(tuple(context[end - n : end]), [])
                ends.insert(0, end)
                del ends[KEEP:]
        self._indexed = max(self._indexed, length - 1)
        found: dict[int, int] = {}  # end -> match length
        for n in range(min(self.max_ngram, length), 0, -1):
            for end in self._ends[n - 1].get(tuple(context[length - n :]), ()):
                if end not in found:
                    found[end] = _match_length(context, end, n)
        ranked = sorted(found.items(), key=lambda item: (-item[1], -item[0]))
        return [(n, end) for end, n in ranked[: self.branches]]

    def extend(self, features: TargetFeatures) -> None:
        pass  # it reads tokens, not the target's features

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        k = min(k, self.max_draft)
        found = self.matches(context) if k > 0 else []
        if not found:
            return None
        if len(found) == 1:
            return Draft(mx.array(_continuation(context, found[0][1], k), mx.int32), Tree.chain(k))
        parents, tokens, scores = [-1], [0], [0.0]
        node: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        total = sum(n * n for n, _ in found)
        for n, start in found:
            parent = 0
            for depth, token in enumerate(_continuation(context, start, k)):
                if (parent, token) not in node:
                    node[parent, token] = len(parents)
                    parents.append(parent)
                    tokens.append(token)
                    scores.append(0.0)
                parent = node[parent, token]
                scores[parent] += n * n / total * (n + 1) / (n + depth + 2)
        best = sorted(sorted(range(1, len(parents)), key=lambda i: -scores[i])[:k])
        index = {0: 0} | {old: new for new, old in enumerate(best, 1)}
        tree = Tree((-1, *(index[parents[i]] for i in best)))
        return Draft(mx.array([tokens[i] for i in best], dtype=mx.int32), tree)

    def rewind(self, length: int) -> None:
        if length < self._indexed:
            self._reset()


def _match_length(context: Sequence[int], end: int, n: int) -> int:
    """How many tokens before `end` equal the context's last ones (n known to), up to MAX_MATCH."""
    length = len(context)
    while n < MAX_MATCH and n < end and context[end - 1 - n] == context[length - 1 - n]:
        n += 1
    return n


def _continuation(context: Sequence[int], start: int, k: int) -> list[int]:
    """The k tokens from `start`; a match overlapping the suffix continues with its own
    proposal (periodic text)."""
    run: list[int] = []
    for j in range(start, start + k):
        run.append(context[j] if j < len(context) else run[j - len(context)])
    return run
