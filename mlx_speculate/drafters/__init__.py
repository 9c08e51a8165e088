"""Drafters propose tokens for the target to verify; all share one protocol.

A drafter sees the context (prompt + emitted tokens; its last token is the one the target
will feed next) and proposes up to `k` tokens as lazy arrays. After verification the loop calls
`rewind(length)`: only the first `length` context tokens are still valid for any state the
drafter keeps (its own cache, for instance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from ..tree import Tree


@dataclass(frozen=True)
class Draft:
    tokens: mx.array  # (k,) proposed tokens; for trees, the non-root nodes in BFS order
    # (k, V) processed log-probabilities the tokens were drawn from, over the target's
    # vocabulary; one-hot rows for deterministic proposals.
    logprobs: mx.array | None = None
    tree: Tree | None = None  # None: a chain

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True)
class TargetState:
    """What the target computed for the tokens committed by the last step."""

    hidden: mx.array  # (n, hidden) final hidden states at the newly committed positions
    layer_hidden: tuple[mx.array, ...] = ()  # (n, hidden) per requested layer


class Drafter(Protocol):
    #: target layers whose hidden states the drafter needs in `TargetState.layer_hidden`
    hidden_layers: tuple[int, ...]

    def propose(self, context: Sequence[int], k: int, state: TargetState | None) -> Draft | None:
        """Up to `k` tokens to follow `context`, or None to decode plainly this step."""

    def rewind(self, length: int) -> None:
        """Forgets everything past the first `length` context tokens."""
