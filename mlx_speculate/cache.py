"""Preallocated key/value cache: in-place writes, O(1) truncation, accepted-path compaction.

Every layer shares one `offset`: the number of committed slots. A forward writes its L new
keys at `offset` in every layer and then `advance(L)` moves the offset past them; rejected
speculation is undone by `truncate`, and a verified tree path is moved into consecutive slots
by `compact` (on the device: the one compaction of compiled and host-committed steps alike).
Storage grows in `step`-sized chunks (one copy per chunk, never a concatenate per token).

Fixed shapes: `write` puts keys at an array start (`mx.slice_update`) and returns the whole
storage, so a forward's graph depends on the capacity alone, not on the offset; attention reads
the leading `span` slots under a mask of the valid ones (models/context.py). A compiled step
reuses its graph until the capacity grows (`reserve`).

Sliding-window layers as rings (`rings`): such a layer keeps only its window plus RING_ROWS
slots, slot j at column j mod R, so its memory and attention stay O(window) at any context
length, as mlx-lm's rotating cache does. Its storage grows as the others' until it reaches R,
then wraps. A forward's attention on such a layer reads the columns as they were before it
(each holds the latest slot below the forward's start that maps to it, `ring_slots`) followed
by its new keys, so its own writes never hide keys its rows still see; rejected drafts and
queued steps write at most RING_ROWS slots past the committed end, which therefore never
reach a key the window still needs, and `truncate` returns exactly (`restorable` says how
far).

Quantized keys and values (models/quantized_kv.py): with a planned `KVCodec` the storage turns
into packed rows once a forward starts at the codec's `start` slot, and every later write is
packed as it is written; the arrays keep their (B, H_kv, capacity, W) layout, so everything
above moves them unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

# Slots past the committed end that forwards which may be rolled back write at most (a verify
# of the widest row bucket and a step queued behind it): a ring holds its window plus these.
RING_ROWS = 128


class KVCodec(Protocol):
    """What a cache and attention read of a quantization (models/quantized_kv.py)."""

    @property
    def start(self) -> int: ...  # the slot from which the cache is stored quantized

    def check_sizes(self, sizes: list[int]) -> None: ...  # a ValueError for a head size it cannot

    def width(self, size: int, dtype: mx.Dtype) -> int: ...  # words per slot of `size` values

    def encode(self, x: mx.array) -> mx.array: ...  # (..., D) float -> (..., W) uint32

    def attention(
        self,
        q: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        mask: mx.array | None,
        sinks: mx.array | None = None,
        softcap: float | None = None,
    ) -> mx.array: ...  # (B, H, L, D) queries over packed (B, Hk, S, W) keys and values


@dataclass(frozen=True)
class Checkpoint:
    """What `KVCache.return_to` needs to set a cache back to `length` slots once it moved on
    past where `truncate` reaches: the rings as they were (by layer, None for other layers),
    and a hybrid's recurrent state at `length` (state_cache.py)."""

    length: int
    high: int
    keys: tuple[mx.array | None, ...]
    values: tuple[mx.array | None, ...]
    codec: KVCodec | None  # how those keys are stored
    recurrent: Any = None


class KVCache:
    follows_trees = True  # whether a verify may be a tree, not only a chain (`check_verify`)

    def __init__(
        self,
        num_layers: int,
        step: int = 256,
        like: mx.array | Sequence[mx.array] | None = None,
        window: int | None = None,
        sliding: Sequence[bool] = (),
    ):
        """`like`: (B, H_kv, 0, D), the shape and dtype of layers not yet written, one for
        all layers or one per layer (Gemma 4's global layers have other head counts and sizes);
        without it layers stay unallocated until written. `sliding[i]`: layer i attends only
        within `window` positions, so it is kept as a ring of window + RING_ROWS slots."""
        if isinstance(like, Sequence) and len(like) != num_layers:
            raise ValueError(f"a {num_layers}-layer cache got {len(like)} layer shapes")
        if sliding and len(sliding) != num_layers:
            raise ValueError(f"a {num_layers}-layer cache got {len(sliding)} sliding flags")
        self.window = window if window is not None and any(sliding) else None
        size = None if self.window is None else self.window + RING_ROWS
        self.rings: list[int | None] = [size if s else None for s in sliding] or [None] * num_layers
        self.high = 0  # host: the end of the furthest slots any forward wrote (or reserved)
        self.step = step
        self.likes = list(like) if isinstance(like, Sequence) else [like] * num_layers
        self.offset = 0
        # Set on a view only (`view`): the array slot a compiled step writes at, and the
        # leading slots its attention reads (`span`; None: the whole capacity).
        self.start: mx.array | None = None
        self.attended: int | None = None
        # Set for a padded forward only (a batch's prefill, batch/prefill.py): each row's real
        # tokens, (B,) int32, the rest padding that a recurrent layer must not take in.
        self.lengths: mx.array | None = None
        # Set by `mark` for a prompt's forward: the slot, per row, whose recurrent state it
        # keeps besides its last (recurrent layers only, state_cache.py).
        self.marks: mx.array | None = None
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        # What the storage holds (None: float keys), and the quantization it switches to once
        # a forward starts at that one's `start` (`quantize_from`).
        self.codec: KVCodec | None = None
        self.planned: KVCodec | None = None
        self._float_likes = self.likes

    @property
    def capacity(self) -> int:
        """The slots the storage holds (a ring's at most its size; rings fill first, so the
        largest layer's); 0 before any is written or for a pipeline rank whose block has no
        attention layer (state_cache.py)."""
        return max((k.shape[2] for k in self.keys if k is not None), default=0)

    @property
    def ring_size(self) -> int | None:
        """The size of the sliding layers' rings (None: no ring)."""
        return None if self.window is None else self.window + RING_ROWS

    def ring_span(self, span: int) -> int:
        """The ring columns a forward attending to the leading `span` slots reads before its
        new keys: all of them once the ring is full."""
        return span if self.ring_size is None else min(span, self.ring_size)

    def capacity_for(self, length: int) -> int:
        """The capacity once `length` slots are reserved: storage only grows, a chunk at a time."""
        return max(self.capacity, -(-length // self.step) * self.step)

    def span(self, end: int) -> int:
        """The leading slots a forward that writes below slot `end` attends to: the first
        of 64, 96, 128, 192, 256, ... (powers of two and 1.5 times them) that holds `end`,
        within the capacity. Attention over unused slots still costs its softmax (on a CPU,
        most of a wide verify), and two sizes an octave keep the traced graphs few."""
        size = 64
        while size < end:
            size = size // 2 * 3 if size & (size - 1) == 0 else size // 3 * 4
        return min(size, max(self.capacity, end))

    def reserve(self, length: int) -> None:
        """Room for `length` slots in every layer, copying what it holds (layers not yet
        written take their `like`; without one they stay unallocated). A planned quantization
        whose start the offset has reached switches first: a compiled step reserves before it
        runs."""
        self._switch()
        self.high = max(self.high, length)
        for layer, (k, like) in enumerate(zip(self.keys, self.likes, strict=True)):
            if k is not None:
                self._reserve(layer, k, self.values[layer], length)
            elif like is not None:
                self._reserve(layer, like, like, length)

    def _reserve(self, layer: int, keys: mx.array, values: mx.array, length: int) -> None:
        """Makes room for `length` slots in `layer` (keys/values give the shape and dtype)."""
        current_k, current_v = self.keys[layer], self.values[layer]
        capacity = self.capacity_for(length)
        if self.rings[layer] is not None:
            capacity = min(capacity, self.rings[layer])
        if current_k is not None and current_k.shape[2] >= capacity:
            return
        B, H, _, Dk = keys.shape
        new_k = mx.zeros((B, H, capacity, Dk), keys.dtype)  # (B, H_kv, capacity, D)
        new_v = mx.zeros((B, H, capacity, values.shape[-1]), values.dtype)
        if current_k is not None:
            # All of it, not just the committed slots: a step queued before the last one was
            # read (decode.py) attends to that one's slots past the offset.
            old = current_k.shape[2]
            new_k[..., :old, :] = current_k
            new_v[..., :old, :] = current_v
        self.keys[layer], self.values[layer] = new_k, new_v

    def write(
        self, layer: int, keys: mx.array, values: mx.array, start: mx.array, end: int | None
    ) -> tuple[mx.array, mx.array]:
        """Writes (B, H_kv, L, D) keys/values at slot `start` (an int32 array, so the graph
        does not depend on it) and returns the whole (B, H_kv, capacity, D) storage. `end`, the
        host's start + L, makes room first; None when the caller reserved it (compiled steps)."""
        return self._put(layer, *self._stored(layer, keys, values, end), start)

    def _stored(
        self, layer: int, keys: mx.array, values: mx.array, end: int | None
    ) -> tuple[mx.array, mx.array]:
        """`keys` and `values` as the storage holds them (encoded), with room made up to the
        host's `end` first (a planned quantization switching first); None: reserved already."""
        if end is not None:
            self._switch()
            self.high = max(self.high, end)
        if self.codec is not None:
            keys, values = self.codec.encode(keys), self.codec.encode(values)
        if end is not None:
            self._reserve(layer, keys, values, end)
        return keys, values

    def _put(
        self, layer: int, keys: mx.array, values: mx.array, start: mx.array
    ) -> tuple[mx.array, mx.array]:
        """`write` into storage with room, of keys and values as stored (encoded)."""
        k, v = self.keys[layer], self.values[layer]
        ring = self.rings[layer]
        if ring is not None and k.shape[2] == ring:  # a full ring: slot j at column j mod R
            L = keys.shape[2]
            if L > ring:  # only the last R slots stay (the earlier ones left every window)
                keys, values = keys[..., -ring:, :], values[..., -ring:, :]
                start, L = start + L - ring, ring
            columns = self.ring_columns(start, L)
            k = mx.put_along_axis(k, mx.broadcast_to(columns, keys.shape), keys, axis=2)
            v = mx.put_along_axis(v, mx.broadcast_to(columns, values.shape), values, axis=2)
        else:
            k = mx.slice_update(k, keys, start[None], axes=(2,))
            v = mx.slice_update(v, values, start[None], axes=(2,))
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def ring_columns(self, start: mx.array, length: int) -> mx.array:
        """The ring columns of slots start .. start + length - 1: (1, 1, L, 1), or (B, 1, L, 1)
        for a batch's (B,) starts."""
        slots = mx.remainder(start[..., None] + mx.arange(length, dtype=mx.int32), self.ring_size)
        return slots.reshape(-1, 1, length, 1)

    def store(
        self,
        layer: int,
        keys: mx.array,
        values: mx.array,
        start: mx.array,
        end: int | None,
        span: int | None,
    ) -> tuple[mx.array, mx.array]:
        """Writes `layer`'s new (B, H_kv, L, D) keys and values (`write`) and returns what its
        attention reads: the leading `span` slots, or on a ring layer its `ring_span(span)`
        columns as they were before this write followed by the L new keys."""
        # (`layer` is the model's index, which caches of hybrids, ringless, map in `write`.)
        if self.ring_size is None or self.rings[layer] is None:
            k, v = self.write(layer, keys, values, start, end)
            if span is not None and span < k.shape[2]:
                k, v = k[..., :span, :], v[..., :span, :]
            return k, v
        # Room first, so that the columns read are the grown storage's.
        keys, values = self._stored(layer, keys, values, end)
        before_k, before_v = self.keys[layer], self.values[layer]
        self._put(layer, keys, values, start)
        n = self.ring_span(span if span is not None else self.capacity)
        return (
            mx.concatenate([before_k[..., :n, :], keys], axis=2),
            mx.concatenate([before_v[..., :n, :], values], axis=2),
        )

    def update(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Writes (B, H_kv, L, D) keys/values at `offset`; returns all slots up to offset + L
        (on a ring layer what `store` returns: the ring's columns, then the L new keys)."""
        end = self.offset + keys.shape[2]
        return self.store(layer, keys, values, mx.array(self.offset, mx.int32), end, end)

    def advance(self, length: int) -> None:
        self.offset += length

    def truncate(self, length: int) -> None:
        """Drops every slot from `length` on (the storage stays; O(1))."""
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot truncate a cache of {self.offset} slots to {length}")
        if self.ring_size is not None and self._ring_restorable(length) != length:
            raise ValueError(
                f"cannot truncate a cache whose sliding layers wrote {self.high} slots to "
                f"{length}: their rings no longer hold that window (only to 0 or from "
                f"{self.high - RING_ROWS - 1})"
            )
        if length == 0:
            self.high = 0
        if self.codec is not None and length < self.codec.start:
            # Slots below the start were float once: only a fresh cache is exact again.
            if length:
                raise ValueError(
                    f"cannot truncate a quantized cache to {length} slots, below its "
                    f"quantized_kv_start of {self.codec.start} (only to 0)"
                )
            self.codec, self.likes = None, self._float_likes
            self.keys, self.values = [None] * len(self.keys), [None] * len(self.values)
        self.offset = length

    def quantize_from(self, codec: KVCodec | None) -> None:
        """Plans `codec`: keys and values are stored quantized once a forward starts at or past
        its `start` slot (at once for 0); None keeps them float. A one-line ValueError where
        a layer's head size does not fit it."""
        if codec is not None:
            codec.check_sizes([like.shape[-1] for like in self.likes if like is not None])
        self.planned = codec
        self._switch()

    def before_switch(self, root: int) -> int:
        """How many slots after `root` a forward from `root` may write before the planned
        quantization's start: a step's draft stays below it, so that each of its rows reads
        the representation plain decoding would give it (unbounded without a switch ahead)."""
        codec = self.planned
        if codec is None or self.codec is not None or root >= codec.start:
            return sys.maxsize
        return codec.start - root - 1

    def _switch(self) -> None:
        """Quantizes the storage (every slot: a row quantizes alone) once the offset reaches
        the planned quantization's start."""
        codec = self.planned
        if codec is None or self.codec is not None or self.offset < codec.start:
            return
        self.codec = codec
        words = [
            None if like is None else codec.width(like.shape[3], like.dtype) for like in self.likes
        ]
        self.likes = [  # (B, H_kv, 0, W)
            None if like is None else mx.zeros((*like.shape[:3], w), mx.uint32)
            for like, w in zip(self.likes, words, strict=True)
        ]
        self.keys = [None if k is None else codec.encode(k) for k in self.keys]
        self.values = [None if v is None else codec.encode(v) for v in self.values]

    def compact(self, start: int | mx.array, path: mx.array) -> None:
        """Moves the keys and values at slots start + path[i] to start + i in every layer: a
        verified tree's accepted path (`path` ascending from 0, the root's 0 first) into
        consecutive slots. On the device, so `start` and `path` may be lazy: a compiled step
        compacts inside its graph and the loop after reading the path, alike. Slots past the
        path get other nodes' keys; the offset is the caller's (the committed path ends at
        start + accepted + 1)."""
        start = mx.array(start, mx.int32) if isinstance(start, int) else start
        if start.ndim == 1:  # a batch (batch/cache.py): row b's path below its own start
            self._rows(start, path)
            return
        slots = start + path  # (P,)
        at = start.reshape(1)
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is None:
                continue
            if self.rings[layer] is not None and k.shape[2] == self.rings[layer]:
                self._rows_of(layer, start[None], path[None])
                continue
            self.keys[layer] = mx.slice_update(k, mx.take(k, slots, axis=2), at, axes=(2,))
            self.values[layer] = mx.slice_update(v, mx.take(v, slots, axis=2), at, axes=(2,))

    def _rows(self, start: mx.array, paths: mx.array) -> None:
        """`compact` of row b's slots start[b] + paths[b, i] to start[b] + i ((B,) starts,
        (B, P) paths, each padded with the identity past its accepted path)."""
        for layer in range(len(self.keys)):
            if self.keys[layer] is not None:
                self._rows_of(layer, start, paths)

    def _rows_of(self, layer: int, start: mx.array, paths: mx.array) -> None:
        """`_rows` in one layer (a full ring's slots at their columns)."""
        B, P = paths.shape
        src = (start[:, None] + paths)[:, None, :, None]  # (B, 1, P, 1)
        dst = (start[:, None] + mx.arange(P, dtype=mx.int32))[:, None, :, None]
        ring = self.rings[layer]
        if ring is not None and self.keys[layer].shape[2] == ring:
            src, dst = mx.remainder(src, ring), mx.remainder(dst, ring)
        for store in (self.keys, self.values):
            a = store[layer]
            shape = (B, a.shape[1], P, a.shape[3])
            moved = mx.take_along_axis(a, mx.broadcast_to(src, shape), axis=2)
            store[layer] = mx.put_along_axis(a, mx.broadcast_to(dst, shape), moved, axis=2)

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate together with a step's outputs."""
        return [a for a in self.keys + self.values if a is not None]

    def adopt(self, arrays: Sequence[mx.array]) -> None:
        """Takes a whole `state` list into a cache fresh from `make_cache` (a compiled step's
        view of its cache inputs, which has no storage to mirror); none: a model without keys."""
        if arrays:
            layers = len(arrays) // 2
            self.keys, self.values = list(arrays[:layers]), list(arrays[layers:])

    def check_verify(self, rows: int, is_chain: bool) -> None:
        """Raises a one-line ValueError when the cache cannot follow a verify of `rows` (padded)
        rows of that shape; keys and values follow any tree, rings up to RING_ROWS // 2 rows (a
        step may be queued behind it). Asked before a step is traced."""
        if self.ring_size is not None and rows > RING_ROWS // 2:
            raise ValueError(
                f"a verify of {rows} rows is wider than a sliding-window cache follows "
                f"({RING_ROWS // 2}): draft fewer tokens a step"
            )

    def restorable(self, length: int) -> int:
        """The longest prefix of at most `length` slots that `truncate` can return to."""
        if self.codec is not None and length < self.codec.start:
            return 0
        return length if self.ring_size is None else self._ring_restorable(length)

    def checkpoint(self, length: int) -> Checkpoint | None:
        """A way back to `length` slots (`return_to`), for as long as no truncation goes below
        it: None where `truncate` will always reach it (no rings) or cannot now. A ring's
        checkpoint holds its storage (O(window)), not a copy: writes make new arrays."""
        if self.ring_size is None or self.restorable(length) != length:
            return None
        rings = [r is not None for r in self.rings]
        keys = tuple(k if ring else None for k, ring in zip(self.keys, rings, strict=True))
        values = tuple(v if ring else None for v, ring in zip(self.values, rings, strict=True))
        return Checkpoint(length, self.high, keys, values, self.codec)

    def mark(self, slots: list[int] | None) -> None:
        """Asks the next forwards for row b's recurrent state at slot slots[b] (within their
        tokens) besides its last: a prompt's end before its last token, so that `checkpoint`
        can return there; None: no more. Only recurrent layers keep it (state_cache.py)."""
        self.marks = None if slots is None else mx.array(slots, dtype=mx.int32)

    def returnable(self, checkpoint: Checkpoint) -> bool:
        """Whether `return_to(checkpoint)` can be taken: the storage is as it was then (not
        quantized since) and holds that many slots."""
        return checkpoint.codec is self.codec and checkpoint.length <= self.offset

    def return_to(self, checkpoint: Checkpoint) -> None:
        """Sets the cache back to `checkpoint.length` slots: the caller truncated nowhere below
        it since the checkpoint was made, so every other layer still holds those slots."""
        if not self.returnable(checkpoint):
            raise ValueError(f"cannot return a cache of {self.offset} slots to {checkpoint.length}")
        for layer, (k, v) in enumerate(zip(checkpoint.keys, checkpoint.values, strict=True)):
            if k is not None:
                self.keys[layer], self.values[layer] = k, v
        self.offset, self.high = checkpoint.length, checkpoint.high

    def _ring_restorable(self, length: int) -> int:
        """`restorable` of the rings: a length whose window no slot written since has reached
        (none overwrote a key it sees, and none past it aliases into one), else 0."""
        return length if length == 0 or self.high <= length + RING_ROWS + 1 else 0

    def ring_slots(self, start: mx.array, columns: int) -> mx.array:
        """The slot each of a ring's leading `columns` holds for a forward from `start` ((B,)
        or ()): the latest below `start` that maps to it (negative: none yet); (..., columns)."""
        s = mx.arange(columns, dtype=mx.int32)
        last = start[..., None] - 1
        return last - mx.remainder(last - s, self.ring_size)

    def take_outputs(self, outputs: Sequence[mx.array]) -> list[mx.array]:
        """A compiled graph's outputs that end with this cache's `state`: takes those arrays
        back (`set_arrays`) and returns the graph's own results, the leading ones."""
        own = len(outputs) - len(self.state)
        self.set_arrays(outputs[own:])
        return list(outputs[:own])

    def set_arrays(self, arrays: Sequence[mx.array]) -> None:
        """Takes a compiled step's cache outputs back (the order of `state`)."""
        it = iter(arrays)
        self.keys = [None if a is None else next(it) for a in self.keys]
        self.values = [None if a is None else next(it) for a in self.values]
