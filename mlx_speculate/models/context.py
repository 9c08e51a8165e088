"""The per-forward context every layer reads: slot start, rotary positions, one rotation
table per forward, and the attention mask over the cache's attended span (causal, tree or
sliding window; over a ring's columns and the new keys on sliding layers kept as rings,
cache.py), built on the device from the slot start so that shapes depend on (L, span) alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..cache import KVCache
from ..graphs import variable
from .rope import RotaryEmbedding


@dataclass(frozen=True)
class ForwardContext:
    """Per-forward state every layer reads: built once, passed down as an argument.

    Fixed shapes: new keys go to cache slot `start` (an int32 array), attention reads the
    leading `span` cache slots under `mask`, so the graph depends on (rows, span) only. `end`
    is the host's start + rows (None inside a compiled step, where the host reserved room).
    """

    cache: KVCache | None
    start: mx.array  # () int32: the first new slot
    end: int | None
    positions: mx.array | None
    seq_len: int  # largest rotary position + 1: what dynamic / longrope frequencies depend on
    mask: mx.array | str | None  # additive (..., L, span), or "causal" without a cache
    window_mask: mx.array | None  # set when a sliding-window layer must mask old keys
    sliding: tuple[bool, ...]
    span: int | None = None  # leading cache slots attention reads (None: no cache)
    # RoPE tables per rotary embedding (by id), built by the first layer that needs them
    rotations: dict[int, tuple[mx.array, ...]] = field(default_factory=dict, compare=False)
    # (B, L, layers, D): what every layer reads besides the residual stream (DecoderStack's
    # `layer_inputs`: Gemma 4's per-layer embeddings), indexed by the model's layer
    layer_inputs: mx.array | None = None
    # The keys and values a layer attended to in this forward, by this process's layer index,
    # recorded for the layers that read them instead of writing their own (Gemma 4)
    kv: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict, compare=False)
    # Sliding layers kept as rings: the mask over the ring's columns then the new keys
    # (..., L, ring_span + L), what `KVCache.store` returns for those layers
    ring_mask: mx.array | None = None

    def layer_mask(self, layer: int) -> mx.array | str | None:
        """The mask `layer`'s attention applies: its ring's or window's on a sliding layer."""
        windowed = self.ring_mask if self.ring_mask is not None else self.window_mask
        return windowed if windowed is not None and self.sliding[layer] else self.mask

    def rotation(self, rope: RotaryEmbedding, length: int, dtype: mx.Dtype) -> tuple:
        """`rope`'s tables for this forward (RotaryEmbedding.tables), shared by its layers."""
        if id(rope) not in self.rotations:
            freqs = rope.freqs(self.seq_len)
            tables = rope.tables(self.start, self.positions, length, freqs, dtype)
            self.rotations[id(rope)] = tables
        return self.rotations[id(rope)]

    def row(self, i: int, rope: RotaryEmbedding, dtype: mx.Dtype) -> ForwardContext:
        """Row i of this consecutive-position forward as a one-row forward of its own: its
        slot, mask row and rotation row, sliced from tables built once for all rows."""
        cos, sin, *rest = self.rotation(rope, self.mask.shape[-2], dtype)
        return ForwardContext(
            self.cache,
            self.start + i,
            None,
            None,
            self.seq_len,
            self.mask[..., i : i + 1, :],
            None,
            self.sliding,
            self.span,
            {id(rope): (cos[i : i + 1], sin[i : i + 1], *rest)},
        )


def additive_mask(allowed: mx.array, dtype: mx.Dtype, prefix: int = 0) -> mx.array:
    """(..., N, M) bool -> (..., N, prefix + M) additive mask: 0 where allowed and on `prefix`
    leading keys (a committed prefix every query sees), else the dtype's most negative finite
    value, since -inf can turn into NaN inside fused attention kernels."""
    mask = mx.where(allowed, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
    if prefix == 0:
        return mask
    return mx.concatenate([mx.zeros((*mask.shape[:-1], prefix), dtype=dtype), mask], axis=-1)


def build_context(
    rope: RotaryEmbedding,
    cache: KVCache | None,
    length: int,
    positions: mx.array | None,
    mask: mx.array | None,
    window: int | None,
    sliding: tuple[bool, ...],
    dtype: mx.Dtype,
) -> ForwardContext:
    """The context of a forward of `length` new tokens. With a cache, keys are written at
    `start` (default: the cache's offset) and attention reads the leading slots: with a host
    offset the first of a few sizes an octave that holds offset + length (`KVCache.span`;
    slots past it are masked anyway, and attending to the whole capacity would cost a short
    context's step most of its time).
    `mask` says who sees whom: a bool (..., L, M) visibility among the last M slots (the new
    ones last; older slots are committed and seen by every new token), or the additive
    (..., L, offset + L) mask of the public contract (host offset only), or causal by
    default. A cache view (`KVCache.view`, inside a compiled step) carries its own array
    start and attended slots: the host reserved room and no shape depends on the offset."""
    start = None if cache is None else cache.start
    if start is not None and start.ndim == 1 and rope.depends_on_length:
        raise ValueError("a batch cannot run a rope whose frequencies depend on the length")
    offset = 0 if cache is None else cache.offset if start is None else None
    end = None if offset is None else offset + length
    if start is None:
        start = mx.array(offset or 0, dtype=mx.int32)
    seq_len = end if end is not None else rope.max_position_embeddings
    if rope.depends_on_length and (positions is not None or end is None):
        # A host sync, only for rope types whose frequencies depend on the largest position.
        last = positions.max() if positions is not None else start + length - 1
        seq_len = int(last.item()) + 1
    windowed = window is not None and any(sliding) and (end is None or end > window)
    if cache is None and not windowed and (mask is None or mask.dtype != mx.bool_):
        mask = None if mask is None else mask.astype(dtype)
        causal_mask = "causal" if mask is None and length > 1 else mask
        return ForwardContext(None, start, end, positions, seq_len, causal_mask, None, sliding)
    if start.ndim == 1:  # a batch: each row writes at its own slot (batch/cache.py)
        seq_len = rope.max_position_embeddings  # the frequencies of rope types a batch runs
        return _batch_context(
            cache, start, length, positions, mask, window, sliding, dtype, seq_len
        )
    if cache is None:
        span = length
    elif end is not None:  # a host offset: attention reads the leading slots up to `end`
        span = cache.span(end)
    else:  # a compiled step's view reads its leading `attended` slots (KVCache.span)
        span = cache.attended or cache.capacity
    slots = mx.arange(span, dtype=mx.int32)
    rel = slots - start  # (C,) index among the new tokens; < 0 for committed slots
    rows = mx.arange(length, dtype=mx.int32)
    causal = rel[None, :] <= rows[:, None]  # (L, C): committed slots and earlier new ones
    if mask is None or mask.dtype != mx.bool_:
        allowed = causal
        additive = None if mask is None else _to_span(mask.astype(dtype), span, offset)
    else:
        m = mask.shape[-1]  # the last m slots up to the new ones (m >= L)
        near = rel + (m - length)  # index among them; < 0 for the older, committed slots
        new = mx.take(mask, mx.clip(near, 0, _bound(m - 1)), axis=-1)  # (..., L, C)
        allowed = (near < 0) | (new & (rel < _bound(length)))
        additive = None
    window_mask = None
    if windowed:
        # Causal by cache slot, distance by rotary position (committed slots sit at their
        # positions, new ones at theirs): (B or 1, 1, L, C).
        q_pos = (start + rows if positions is None else positions).reshape(-1, length)
        k_pos = mx.where(
            rel < 0, slots, mx.take(q_pos, mx.clip(rel, 0, _bound(length - 1)), axis=-1)
        )
        near = q_pos[:, :, None] - k_pos[:, None, :] < window
        window_mask = additive_mask(allowed & near, dtype)[:, None]
        if additive is not None:
            window_mask = mx.minimum(window_mask, additive)
    if additive is None:
        additive = additive_mask(allowed, dtype)
    ring_mask = None
    if cache is not None and cache.ring_size is not None and window is not None and any(sliding):
        ring_mask = _ring_mask(cache, start, length, span, positions, mask, window, dtype, offset)
    return ForwardContext(
        cache,
        start,
        end,
        positions,
        seq_len,
        additive,
        window_mask,
        sliding,
        None if cache is None else span,
        ring_mask=ring_mask,
    )


def _ring_mask(
    cache: KVCache,
    start: mx.array,
    length: int,
    span: int,
    positions: mx.array | None,
    mask: mx.array | None,
    window: int,
    dtype: mx.Dtype,
    offset: int | None,
) -> mx.array:
    """The additive mask of a ring layer's attention, (B or 1, 1, L, ring_span + L): over the
    slots its columns hold before this forward (`KVCache.ring_slots`) and then the L new ones,
    with the same visibility and window as `build_context` gives the cache's slots."""
    rows = mx.arange(length, dtype=mx.int32)
    ids = mx.concatenate([cache.ring_slots(start, cache.ring_span(span)), start + rows])
    rel = ids - start  # (C,) index among the new tokens; < 0 for committed slots
    held = ids >= 0
    additive = None
    if mask is not None and mask.dtype == mx.bool_:
        m = mask.shape[-1]
        near = rel + (m - length)
        new = mx.take(mask, mx.clip(near, 0, _bound(m - 1)), axis=-1)  # (..., L, C)
        allowed = held & ((near < 0) | (new & (rel < _bound(length))))
    else:
        allowed = held & (rel[None, :] <= rows[:, None])
        if mask is not None:  # the public (..., L, offset + L) additive mask, by slot
            last = (0 if offset is None else offset) + length - 1
            additive = mx.take(mask.astype(dtype), mx.clip(ids, 0, _bound(last)), axis=-1)
    q_pos = (start + rows if positions is None else positions).reshape(-1, length)
    k_pos = mx.where(rel < 0, ids, mx.take(q_pos, mx.clip(rel, 0, _bound(length - 1)), axis=-1))
    near = q_pos[:, :, None] - k_pos[:, None, :] < window
    ring_mask = additive_mask(allowed & near, dtype)[:, None]
    return ring_mask if additive is None else mx.minimum(ring_mask, additive)


def _to_span(mask: mx.array, span: int, offset: int | None) -> mx.array:
    """An additive (..., L, offset + L) mask padded to (..., L, span) with hidden slots."""
    if offset is None:
        raise ValueError("an additive mask over cached + new keys needs the cache's host offset")
    pad = span - mask.shape[-1]
    hidden = mx.full((*mask.shape[:-1], pad), mx.finfo(mask.dtype).min, dtype=mask.dtype)
    return mx.concatenate([mask, hidden], axis=-1)


def _batch_context(
    cache: KVCache,
    start: mx.array,
    length: int,
    positions: mx.array | None,
    mask: mx.array | None,
    window: int | None,
    sliding: tuple[bool, ...],
    dtype: mx.Dtype,
    seq_len: int,
) -> ForwardContext:
    """The context of a batch forward whose row b writes its `length` new keys at slot
    start[b] of its own cache row: committed slots are those below start[b], so rows of any
    lengths share one forward and no row sees another's or its own stale slots. `mask`: None
    (causal) or a bool (B, L, L) visibility among each row's new tokens (its draft tree);
    masks come out (B, 1, L, span)."""
    if mask is not None and (mask.dtype != mx.bool_ or mask.shape[-1] != length):
        raise ValueError("a batch forward takes a bool (B, L, L) mask among its new tokens")
    span = cache.attended or cache.capacity
    slots = mx.arange(span, dtype=mx.int32)
    rel = slots[None, :] - start[:, None]  # (B, C): index among the row's new tokens
    rows = mx.arange(length, dtype=mx.int32)
    if mask is None:
        allowed = rel[:, None, :] <= rows[None, :, None]  # (B, L, C)
    else:
        near = mx.clip(rel, 0, _bound(length - 1))[:, None, :]
        new = mx.take_along_axis(mask, mx.broadcast_to(near, (mask.shape[0], length, span)), -1)
        allowed = (rel < 0)[:, None, :] | (new & (rel < _bound(length))[:, None, :])
    window_mask = ring_mask = None
    if window is not None and any(sliding):
        q_pos = start[:, None] + rows if positions is None else positions  # (B, L)
        at = mx.clip(rel, 0, _bound(length - 1))
        k_pos = mx.where(rel < 0, slots[None, :], mx.take_along_axis(q_pos, at, axis=-1))
        near = q_pos[:, :, None] - k_pos[:, None, :] < window  # (B, L, C)
        window_mask = additive_mask(allowed & near, dtype)[:, None]
        if cache.ring_size is not None:
            ring_mask = _batch_ring_mask(cache, start, length, span, q_pos, mask, window, dtype)
    return ForwardContext(
        cache,
        start,
        None,
        positions,
        seq_len,
        additive_mask(allowed, dtype)[:, None],
        window_mask,
        sliding,
        span,
        ring_mask=ring_mask,
    )


def _batch_ring_mask(
    cache: KVCache,
    start: mx.array,
    length: int,
    span: int,
    q_pos: mx.array,
    mask: mx.array | None,
    window: int,
    dtype: mx.Dtype,
) -> mx.array:
    """`_ring_mask` of a batch forward, row b from its own start[b]: (B, 1, L, ring_span + L)."""
    rows = mx.arange(length, dtype=mx.int32)
    old = cache.ring_slots(start, cache.ring_span(span))  # (B, R')
    ids = mx.concatenate([old, start[:, None] + rows[None, :]], axis=1)  # (B, C)
    rel = ids - start[:, None]
    if mask is None:
        allowed = rel[:, None, :] <= rows[None, :, None]  # (B, L, C)
    else:
        at = mx.clip(rel, 0, _bound(length - 1))[:, None, :]
        new = mx.take_along_axis(mask, mx.broadcast_to(at, (*mask.shape[:2], ids.shape[1])), -1)
        allowed = (rel < 0)[:, None, :] | (new & (rel < _bound(length))[:, None, :])
    allowed = allowed & (ids >= 0)[:, None, :]
    at = mx.clip(rel, 0, _bound(length - 1))
    k_pos = mx.where(rel < 0, ids, mx.take_along_axis(q_pos, at, axis=-1))
    near = q_pos[:, :, None] - k_pos[:, None, :] < window  # (B, L, C)
    return additive_mask(allowed & near, dtype)[:, None]


def _bound(n: int) -> mx.array:
    """A width or a step's length, as the graph's input (`graphs.variable`): trees of every
    width then share their kernels."""
    return variable(n, mx.int32)
