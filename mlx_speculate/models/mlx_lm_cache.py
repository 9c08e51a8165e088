"""The cache of a model that runs through mlx-lm's own module (mlx_lm_model.py): mlx-lm's
per-layer caches (`make_prompt_cache`) behind this package's `KVCache` contract.

mlx-lm's modules write at their caches' own offsets and build their causal mask from them, so
a forward at slot p first brings the caches to p (`MlxLmState.seek`). Layers whose caches trim
exactly (mlx-lm's `KVCache`, its quantized and concatenating kinds) drop the slots past p.
Any other cache (a recurrent state: Mamba, short convolutions, DeltaNet; a sliding window that
may have wrapped) cannot drop tokens, so each forward first keeps a copy of those layers'
states; going back to p then restores that copy, trims the others to the same slot and replays
the tokens between it and p (one forward), the exact state after them, as a forward of those
tokens computes it. A forward thus reaches back at most to where the last one started (or to 0:
fresh caches): `restorable` says so, as the hybrid cache of state_cache.py does.

The loop's `offset` (committed slots) is kept apart from what mlx-lm's caches hold: a verify
writes all its rows and the loop truncates to the accepted ones; the next forward seeks.
The model is never traced (`traceable` is False), so a step's cache view is built eagerly: the
`state` list ends with the `MlxLmState` itself, which the view (`adopt`) shares, while its
arrays are what evaluating a step computes. Trees are refused (mlx-lm masks causally).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_lm_cache

from ..cache import KVCache
from . import needs_native

# Caches whose `trim` drops the last slots exactly, whatever they hold.
TRIMMING = (mlx_lm_cache.KVCache, mlx_lm_cache.QuantizedKVCache, mlx_lm_cache.ConcatenateKVCache)


def trims(cache) -> bool:
    """Whether an mlx-lm layer cache rolls back by `trim` (else by a copy and a replay)."""
    if isinstance(cache, mlx_lm_cache.CacheList):
        return all(trims(c) for c in cache.caches)
    return isinstance(cache, TRIMMING)


def _copy(state):
    """A layer cache's `state` with every array a new handle: an in-place update of the cache
    (mlx-lm writes some slices in place) leaves the copy as it was."""
    return tree_map(lambda a: mx.array(a) if isinstance(a, mx.array) else a, state)


class MlxLmState:
    """mlx-lm's caches for one sequence and what rolls them back: `position`, the tokens they
    hold; the copied states of the layers that do not trim, taken where the last forward
    started (`kept_at`), and the (B, L) tokens fed since (`fed`)."""

    def __init__(self, module, fresh: Callable[[], list]):
        self.module = module  # the mlx-lm model, which replays tokens
        self.fresh = fresh
        self.layers = fresh()
        self.trimming = [trims(c) for c in self.layers]
        self.replays = not all(self.trimming)
        self.position = 0
        self.kept_at = 0
        self.kept: list | None = None
        self.fed: mx.array | None = None

    def restorable(self, length: int) -> int:
        """The longest prefix of at most `length` slots that `seek` can return to."""
        if not self.replays or length == 0 or self.kept_at <= length <= self.position:
            return length
        return 0

    def unreachable(self, slot: int) -> str:
        """Why `seek` cannot return to `slot`, in one line."""
        return (
            f"cannot roll mlx-lm's caches back to {slot} tokens: only {self.kept_at} to "
            f"{self.position} (the last forward's rows) are kept"
        )

    def seek(self, slot: int) -> None:
        """Brings the caches to hold exactly the first `slot` tokens (ValueError where it
        cannot: see `restorable`)."""
        if slot == self.position:
            return
        if slot > self.position:
            raise ValueError(f"cannot write at slot {slot}: the cache holds {self.position}")
        if not self.replays:
            for c in self.layers:
                c.trim(self.position - slot)
            self.position = slot
            return
        if slot == 0:
            self.layers, self.position, self.kept, self.fed = self.fresh(), 0, None, None
            return
        if self.restorable(slot) != slot or self.kept is None:
            raise ValueError(self.unreachable(slot))
        for c, trimming, state in zip(self.layers, self.trimming, self.kept, strict=True):
            if trimming:
                c.trim(self.position - self.kept_at)
            else:
                c.state = _copy(state)
        replay = self.fed[:, : slot - self.kept_at]
        self.position, self.kept = self.kept_at, None
        if slot > self.position:
            self.run(replay)

    def run(self, tokens: mx.array) -> mx.array:
        """mlx-lm's logits (B, L, V) for `tokens` (B, L) written from `position` on, the
        non-trimming layers' states kept first."""
        if self.replays:
            layers = zip(self.layers, self.trimming, strict=True)
            self.kept = [None if trimming else _copy(c.state) for c, trimming in layers]
            self.kept_at, self.fed = self.position, tokens
        logits = self.module(tokens, cache=self.layers)
        self.position += tokens.shape[1]
        return logits

    def arrays(self) -> list[mx.array]:
        """Every array the caches hold (what evaluating a step computes)."""
        leaves = tree_flatten([c.state for c in self.layers])
        return [a for _, a in leaves if isinstance(a, mx.array)]


class MlxLmCache(KVCache):
    """`KVCache`'s contract over an `MlxLmState`: `offset` is the loop's committed length; a
    forward writes at `start` (a step's view) or the offset, seeking there first."""

    def __init__(self, state: MlxLmState, model_type: str):
        super().__init__(0)  # no key/value storage of its own
        self.core = state
        self.model_type = model_type

    def forward(self, tokens: mx.array) -> mx.array:
        """mlx-lm's logits (B, L, V) for `tokens` written at this cache's slot; advances."""
        slot = self.offset if self.start is None else int(self.start.item())  # eager: no trace
        self.core.seek(slot)
        logits = self.core.run(tokens)
        self.advance(tokens.shape[1])
        return logits

    def check_verify(self, rows: int, is_chain: bool) -> None:
        if not is_chain:
            raise ValueError(needs_native("a draft tree", self.model_type))

    def restorable(self, length: int) -> int:
        return self.core.restorable(length)

    def truncate(self, length: int) -> None:
        """As `KVCache.truncate`, where the caches can return (`restorable`); the caches seek
        there at the next forward."""
        if length != self.offset and self.core.restorable(length) != length:
            raise ValueError(self.core.unreachable(length))
        super().truncate(length)

    def reserve(self, length: int) -> None:
        pass  # mlx-lm's caches grow themselves

    def span(self, end: int) -> int:
        """No bound: mlx-lm's layers attend to what their caches hold. One value, so that a
        step's function (graphs.py, keyed by the span) is built once per shape."""
        return 0

    @property
    def state(self) -> list:
        """The caches' arrays, then the `MlxLmState` itself, which a view shares (`adopt`)."""
        return [*self.core.arrays(), self.core]

    def adopt(self, arrays: Sequence) -> None:
        self.core = arrays[-1]

    def set_arrays(self, arrays: Sequence) -> None:
        pass  # the view wrote into the shared state
