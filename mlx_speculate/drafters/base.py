"""The drafter protocol, what drafters hand the loop, and the base of every method's spec.

A drafter proposes tokens for the target to verify. It sees the context (prompt + emitted
tokens; the last one is pending: emitted, not yet in the target cache) and the target's own
features of every committed position, handed over in order by `extend` (the prompt's at
prefill, then each step's accepted path). `rewind(length)` says that only the first `length`
context tokens are still committed, so any state past them (a draft cache, say) is stale.

A method is a frozen spec (`DrafterSpec` subclass) whose `build` validates that it fits the
target and returns a fresh drafter; one drafter serves one stream of prompts at a time. Each
spec class registers itself in `METHODS` when defined, with the `stream_generate` keywords and
CLI flags it owns, so the API, the CLIs and the server resolve methods in one place
(`drafters/__init__.py`, `drafters/cli.py`).
"""

from __future__ import annotations

import argparse
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..tree import Tree

if TYPE_CHECKING:
    from ..step import Then


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
    """What the loop asks of every drafter: its features, its state and its proposals."""

    #: target layers whose entering hidden states `extend` must carry in `TargetFeatures.taps`
    taps: tuple[int, ...]
    #: the most draft tokens one proposal holds (tree: nodes below the root)
    max_draft: int
    #: True when `propose` drafts after whatever context it is handed (a draft model, prompt
    #: lookup), so a grammar's forced run may come before its draft; False when it drafts
    #: from the target's features at the pending position (heads), so its draft hangs below
    #: that token and a forced run is a step of its own (grammar/constraint.py)
    follows_context: bool

    def weights(self) -> tuple[nn.Module, ...]:
        """The modules it drafts with (none for prompt lookup): its speed, its calibration key
        and the prices shared with other drafters over the same weights depend on them."""

    def extend(self, features: TargetFeatures) -> None:
        """The target's features of the next committed positions, in order."""

    def rewind(self, length: int) -> None:
        """Only the first `length` context tokens are still committed."""

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        """Up to `k` tokens to follow `context`, or None to decode plainly this step. Sampled
        proposals follow `sampling` (the target's settings), so rejection sampling is lossless."""


@runtime_checkable
class PipelinedDrafter(Drafter, Protocol):
    """A drafter whose next proposal can be queued before the step verifying its last one is
    read: the loop builds the next step on that step's lazy accepted count, so building it
    overlaps the verify, and tells the drafter the count once read."""

    def follow(
        self,
        drafted: mx.array,
        accepted: mx.array,
        pending: mx.array,
        k: int,
        sampling: SamplingParams,
    ) -> Draft | None:
        """The next proposal of up to `k` tokens, lazy in `accepted` (an int32 scalar: how many
        of the last proposal's tokens `drafted` the target accepted) and in the `pending`
        token (1,) it chose after them; None when it cannot be queued (`propose` then runs
        once the count is read)."""

    def settle(self, accepted: int) -> None:
        """The oldest queued step accepted `accepted` drafts (read on the host)."""


@runtime_checkable
class FusedDrafter(PipelinedDrafter, Protocol):
    """A pipelined drafter whose next draft is traced into the verify step's own graph (EAGLE:
    the head runs over the accepted path and grows the next tree in the same call)."""

    def then(self) -> Then | None:
        """The work to trace after this step's acceptance rule, or None to draft by `propose`
        (or `follow`) instead."""

    def received(self, outputs: Sequence[mx.array]) -> None:
        """That work's lazy outputs (`Verified.then`), in the order its trace returned them."""


MAX_DRAFT = 8  # the longest chain the adaptive policy tries unless a spec says otherwise


# Every method by its name (`DrafterSpec.method`), in definition order: filled by the specs.
METHODS: dict[str, type[DrafterSpec]] = {}


@dataclass(frozen=True, kw_only=True, eq=False)
class DrafterSpec(ABC):
    """What every method's spec carries besides its own settings."""

    #: the method's name in requests (the server's `speculative.method`): by default the class
    #: name in snake case without "Spec" (`DraftModelSpec` -> "draft_model")
    method: ClassVar[str]
    #: the `stream_generate` keywords the method owns -> the spec field each sets. The first
    #: turns the method on; its value fills that field (None: a switch, `prompt_lookup=True`).
    keywords: ClassVar[dict[str, str | None]]
    #: each keyword's command-line flag(s), so that errors speak the CLI's words
    flags: ClassVar[dict[str, str]]
    #: True when its drafts need only the target's logits (a draft model, prompt lookup), so
    #: it runs on a target of any `CausalLM.implementation`; False: heads read the target's
    #: features, and need a native one
    logits_only: ClassVar[bool] = False

    # Draft tokens per step (tree: nodes below the root); None lets the adaptive policy choose
    # from measured costs and acceptance, plain decoding included.
    num_draft_tokens: int | None = None
    # Typical acceptance when sampling: faster, but LOSSY (the output no longer follows the
    # target's distribution). Never the default; only methods owning the keyword take it.
    typical_acceptance: bool = False

    def __post_init__(self) -> None:
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(
                f"the number of draft tokens must be >= 1, got {self.num_draft_tokens} "
                "(for plain decoding, ask for no speculation)"
            )
        if self.typical_acceptance and "typical_acceptance" not in self.keywords:
            owners = [m for m, c in METHODS.items() if "typical_acceptance" in c.keywords]
            raise ValueError(f"typical_acceptance applies to {' or '.join(owners)} only")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "method" not in cls.__dict__:
            cls.method = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Spec")).lower()
        METHODS[cls.method] = cls

    @classmethod
    def selector(cls) -> str:
        """The keyword that turns the method on."""
        return next(iter(cls.keywords))

    @classmethod
    def from_keywords(cls, given: dict[str, Any], **common: Any) -> DrafterSpec:
        """The spec from its own keywords (`given` holds no others) and the settings every
        method takes; ValueError when two keywords name the same field."""
        fields: dict[str, Any] = dict(common)
        named: dict[str, str] = {}
        for keyword, value in given.items():
            field = cls.keywords[keyword]
            if field is None:
                continue
            if field in fields:
                raise ValueError(f"give {named[field]} or {keyword}, not both")
            fields[field], named[field] = value, keyword
        return cls(**fields)

    @classmethod
    @abstractmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        """Adds the method's command-line flags (every default None or False: not given)."""

    @classmethod
    @abstractmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The `stream_generate` keywords that the parsed flags give (those set only)."""

    def resolve(self, target: CausalLM) -> DrafterSpec:
        """This spec with what it names on disk (a model, heads) loaded, so that building
        drafters from it again reads nothing: a server builds one per cached prompt."""
        return self

    @abstractmethod
    def build(self, target: CausalLM, tokenizer=None) -> Drafter:
        """A fresh drafter for `target` (whose tokenizer is `tokenizer`, or the one `load`
        gave it); raises ValueError when the method does not fit the target."""
