"""The protocol every draft head follows, so drafters and trainers need no per-head switches.

A head reads the target's own features: `inputs` picks, from the target's final states and the
states entering the layers named by `taps`, the rows a first level reads. A recurrent head
(EAGLE) runs a level over positions with its own cache (`make_cache`; None for heads without
one, such as Medusa's) and feeds its output back for the next level; `logits` scores the head's
vocabulary and `to_target` maps its ids onto the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx

from ..cache import KVCache
from ..models.base import CausalLM


class DraftHead(Protocol):
    def taps(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose entering states `inputs` reads, for a target this deep."""

    def inputs(self, hidden: mx.array, taps: Sequence[mx.array]) -> mx.array:
        """(n, F) the rows a first level reads, from (n, h) final states and (n, h) taps."""

    def make_cache(self) -> KVCache | None:
        """A fresh cache for the head's own positions (None: the head keeps none)."""

    def to_target(self, ids: mx.array) -> mx.array:
        """Ids of the head's vocabulary -> the target's."""

    def check_fits(self, target: CausalLM) -> tuple[int, ...]:
        """Raises ValueError unless the head fits `target`; returns `taps` for its depth."""
