"""Pipeline parallelism over an `mx.distributed` group: rank r keeps a contiguous block of the
target's layers (rank 0 the first ones), as mlx-lm's `pipeline` does, for links too slow for
tensor parallelism's two all-sums per layer.

A forward: every rank embeds the tokens (embeddings, final norm and lm_head stay whole on
every rank); rank 0 runs its block and hands the (B, L, hidden) activations on to rank 1,
which runs its block and hands on; the last rank's output reaches every rank, so that every
rank computes the same logits and decoding runs unchanged and identically on all ranks, as in
tensor mode. Each hand-over is an all_sum to which the other ranks add zeros (`size` per
forward, whatever the layer count), not a send/recv pair: a receive has no inputs, so in a
graph holding two forwards a rank could wait on the second one's receive while its peer waits
on the first one's collective. Here every collective's input follows the previous one, and the
rank's KV cache follows the forward's last one, so every rank runs them in one order and
evaluating the cache (what prefill does) runs them all. The ranks compute one after another:
a split saves memory per rank, not time. Each rank's cache holds its own layers only: a
hybrid's recurrent state too (state_cache.py), which each rank keeps per row and rolls back for
the layers it runs, every rank truncating to the same accepted length; a block may hold no
attention layer. A family whose layers read other layers' keys (Gemma 4's KV sharing) refuses,
in one line, a split between a layer and its source (models/gemma4.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache


def layer_block(layers: int, size: int, rank: int) -> slice:
    """Rank `rank`'s contiguous share of `layers` (the first ranks take one more when they do
    not divide)."""
    per, extra = divmod(layers, size)
    start = rank * per + min(rank, extra)
    return slice(start, start + per + (rank < extra))


@dataclass(frozen=True)
class PipelineStage:
    """The models.stage.Stage of one rank of `group`; `blocks` is every rank's layer block."""

    group: mx.distributed.Group
    blocks: tuple[slice, ...]

    @property
    def start(self) -> int:
        return self.blocks[self.group.rank()].start

    def enter(self, h: mx.array, cache: KVCache | None) -> mx.array:
        after = [h, *(() if cache is None else cache.state)]  # the previous forward's end
        for source in range(self.group.rank()):
            h = self._from(source, h, after)
            after = [h]
        return h

    def leave(
        self,
        h: mx.array,
        captured: dict[int, mx.array],
        taps: tuple[int, ...],
        cache: KVCache | None,
    ) -> tuple[mx.array, tuple[mx.array, ...]]:
        for source in range(self.group.rank(), self.group.size()):
            h = self._from(source, h, [h])
        shared: list[mx.array] = []
        for i in taps:
            owner = next(r for r, b in enumerate(self.blocks) if b.start <= i < b.stop)
            shared.append(self._from(owner, captured.get(i, h), [h, *shared]))
        if cache is not None:
            cache.set_arrays(mx.depends(cache.state, [h, *shared]))
        return h, tuple(shared)

    def _from(self, source: int, h: mx.array, after: list[mx.array]) -> mx.array:
        """Rank `source`'s `h` on every rank (the others add zeros); every rank's input waits
        on `after`, so that the ranks run their collectives in the same order."""
        mine = h if self.group.rank() == source else mx.zeros_like(h)
        return mx.distributed.all_sum(mx.depends(mine, after), group=self.group)


def split_layers(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """Keeps this rank's block of `model`'s layers (in place; the weights of the others are
    dropped unread when `model` was loaded lazily); returns it."""
    size, layers = group.size(), model.args.num_hidden_layers
    if layers < size:
        raise ValueError(f"cannot split {layers} layers over {size} ranks: fewer layers than ranks")
    blocks = tuple(layer_block(layers, size, rank) for rank in range(size))
    model.model.keep(PipelineStage(group, blocks), blocks[group.rank()])
    return model
