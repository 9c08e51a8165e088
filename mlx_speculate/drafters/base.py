"""The drafter protocol, what drafters hand the loop, and the base of every method's spec.

A drafter proposes tokens for the target to verify. It sees the context (prompt + emitted
tokens; the last one is pending: emitted, not yet in the target cache) and the target's own
features of every committed position, handed over in order by `extend` (the prompt's at
prefill, then each step's accepted path). `rewind(length)` says that only the first `length`
context tokens are still committed, so any state past them (a draft cache, say) is stale.

A method is a frozen spec (`DrafterSpec` subclass) whose `build` validates that it fits the
target and returns a fresh drafter; one drafter serves one stream of prompts at a time.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import mlx.core as mx

from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..tree import Tree


@dataclass(frozen=True)
class Draft:
    tokens: mx.array  # (N - 1,) int32: the tokens of the tree's non-root nodes, in node order
    tree: Tree  # its shape; Tree.chain(k) for a chain of k tokens
    # (M, V) by parent: row i is the processed distribution (over the target's vocabulary)
    # that node i's children were drawn from, for every node i < M that has children. None
    # when the children are deterministic picks (top-k, n-gram lookup).
    logprobs: mx.array | None = None

    @property
    def size(self) -> int:
        return self.tree.num_nodes - 1

    def limited(self, depth: int) -> Draft:
        """The nodes at most `depth` deep: a step accepts at most that many drafts."""
        if self.tree.depth <= depth:
            return self
        kept = [i for i, d in enumerate(self.tree.depths) if d <= depth]
        tokens = self.tokens[mx.array(kept[1:], dtype=mx.int32) - 1]
        logprobs = self.logprobs
        if logprobs is not None:
            rows = [i for i in kept if i < logprobs.shape[0]]
            logprobs = logprobs[mx.array(rows, dtype=mx.int32)]
        return Draft(tokens, self.tree.subtree(kept), logprobs)


@dataclass(frozen=True)
class TargetFeatures:
    """What the target computed at some committed positions, one row each."""

    hidden: mx.array  # (n, hidden): the final-norm output, i.e. lm_head's input
    taps: tuple[mx.array, ...] = ()  # (n, hidden) per requested layer: the state entering it

    def rows(self, index: mx.array | slice) -> TargetFeatures:
        return TargetFeatures(self.hidden[index], tuple(t[index] for t in self.taps))


class Drafter(Protocol):
    #: target layers whose entering hidden states `extend` must carry in `TargetFeatures.taps`
    taps: tuple[int, ...]
    #: the most draft tokens one proposal holds (tree: nodes below the root)
    max_draft: int

    def extend(self, features: TargetFeatures) -> None:
        """The target's features of the next committed positions, in order."""

    def rewind(self, length: int) -> None:
        """Only the first `length` context tokens are still committed."""

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        """Up to `k` tokens to follow `context`, or None to decode plainly this step. Sampled
        proposals follow `sampling` (the target's settings), so rejection sampling is lossless."""


MAX_DRAFT = 8  # the longest chain the adaptive policy tries unless a spec says otherwise


@dataclass(frozen=True, kw_only=True, eq=False)
class DrafterSpec(ABC):
    """What every method's spec carries besides its own settings."""

    #: the method's name in requests (the server's `speculative.method`): by default the class
    #: name in snake case without "Spec" (`DraftModelSpec` -> "draft_model")
    method: ClassVar[str]

    # Draft tokens per step (tree: nodes below the root); None lets the adaptive policy choose
    # from measured costs and acceptance, plain decoding included.
    num_draft_tokens: int | None = None
    # Medusa's typical acceptance when sampling: faster, but LOSSY (the output no longer
    # follows the target's distribution). Never the default.
    typical_acceptance: bool = False

    def __post_init__(self) -> None:
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(
                f"the number of draft tokens must be >= 1, got {self.num_draft_tokens} "
                "(for plain decoding, ask for no speculation)"
            )

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "method" not in cls.__dict__:
            cls.method = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Spec")).lower()

    def resolve(self, target: CausalLM) -> DrafterSpec:
        """This spec with what it names on disk (a model, heads) loaded, so that building
        drafters from it again reads nothing: a server builds one per cached prompt."""
        return self

    @abstractmethod
    def build(self, target: CausalLM, tokenizer=None) -> Drafter:
        """A fresh drafter for `target` (whose tokenizer is `tokenizer`, or the one `load`
        gave it); raises ValueError when the method does not fit the target."""
