"""What a decoder stack needs from pipeline parallelism (mlx_speculate/pipeline.py builds it):
the models know the protocol, not the distributed backend."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from ..cache import KVCache


class Stage(Protocol):
    """The block of layers this process runs when the layers are split across processes
    (pipeline.py): `layers` then holds only those, and the cache only theirs."""

    start: int  # the index of its first layer in the whole model

    def enter(self, h: mx.array, cache: KVCache | None) -> mx.array:
        """The hidden state entering the block, (B, L, hidden), given the embedded tokens."""
        ...

    def leave(
        self,
        h: mx.array,
        captured: dict[int, mx.array],
        taps: tuple[int, ...],
        cache: KVCache | None,
    ) -> tuple[mx.array, tuple[mx.array, ...]]:
        """The last layer's output and the requested taps (the states entering those layers),
        on every process, given this block's output and the taps it captured."""
        ...


class Whole:
    """The stage of a model that runs all its layers in one process."""

    start = 0

    def enter(self, h: mx.array, cache: KVCache | None) -> mx.array:
        return h

    def leave(
        self,
        h: mx.array,
        captured: dict[int, mx.array],
        taps: tuple[int, ...],
        cache: KVCache | None,
    ) -> tuple[mx.array, tuple[mx.array, ...]]:
        return h, tuple(captured[i] for i in taps)


WHOLE = Whole()
