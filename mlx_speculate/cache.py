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

Quantized keys and values (models/quantized_kv.py): with a planned `KVCodec` the storage turns
into packed rows once a forward starts at the codec's `start` slot, and every later write is
packed as it is written; the arrays keep their (B, H_kv, capacity, W) layout, so everything
above moves them unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx


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


class KVCache:
    def __init__(
        self,
        num_layers: int,
        step: int = 256,
        like: mx.array | Sequence[mx.array] | None = None,
    ):
        """`like`: (B, H_kv, 0, D), the shape and dtype of layers not yet written, one for
        all layers or one per layer (Gemma 4's global layers have other head counts and sizes);
        without it layers stay unallocated until written."""
        if isinstance(like, Sequence) and len(like) != num_layers:
            raise ValueError(f"a {num_layers}-layer cache got {len(like)} layer shapes")
        self.step = step
        self.likes = list(like) if isinstance(like, Sequence) else [like] * num_layers
        self.offset = 0
        # Set on a view only (`view`): the array slot a compiled step writes at, and the
        # leading slots its attention reads (`span`; None: the whole capacity).
        self.start: mx.array | None = None
        self.attended: int | None = None
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        # What the storage holds (None: float keys), and the quantization it switches to once
        # a forward starts at that one's `start` (`quantize_from`).
        self.codec: KVCodec | None = None
        self.planned: KVCodec | None = None
        self._float_likes = self.likes

    @property
    def capacity(self) -> int:
        # No layers: a pipeline rank whose block has no attention layer (state_cache.py).
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]

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
        for layer, (k, like) in enumerate(zip(self.keys, self.likes, strict=True)):
            if k is not None:
                self._reserve(layer, k, self.values[layer], length)
            elif like is not None:
                self._reserve(layer, like, like, length)

    def _reserve(self, layer: int, keys: mx.array, values: mx.array, length: int) -> None:
        """Makes room for `length` slots in `layer` (keys/values give the shape and dtype)."""
        current_k, current_v = self.keys[layer], self.values[layer]
        capacity = self.capacity_for(length)
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
        if end is not None:
            self._switch()
        if self.codec is not None:
            keys, values = self.codec.encode(keys), self.codec.encode(values)
        if end is not None:
            self._reserve(layer, keys, values, end)
        k = mx.slice_update(self.keys[layer], keys, start[None], axes=(2,))
        v = mx.slice_update(self.values[layer], values, start[None], axes=(2,))
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def update(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Writes (B, H_kv, L, D) keys/values at `offset`; returns all slots up to offset + L."""
        end = self.offset + keys.shape[2]
        k, v = self.write(layer, keys, values, mx.array(self.offset, mx.int32), end)
        return k[..., :end, :], v[..., :end, :]

    def advance(self, length: int) -> None:
        self.offset += length

    def truncate(self, length: int) -> None:
        """Drops every slot from `length` on (the storage stays; O(1))."""
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot truncate a cache of {self.offset} slots to {length}")
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
            self.keys[layer] = mx.slice_update(k, mx.take(k, slots, axis=2), at, axes=(2,))
            self.values[layer] = mx.slice_update(v, mx.take(v, slots, axis=2), at, axes=(2,))

    def _rows(self, start: mx.array, paths: mx.array) -> None:
        """`compact` of row b's slots start[b] + paths[b, i] to start[b] + i ((B,) starts,
        (B, P) paths, each padded with the identity past its accepted path)."""
        B, P = paths.shape
        src = (start[:, None] + paths)[:, None, :, None]  # (B, 1, P, 1)
        dst = (start[:, None] + mx.arange(P, dtype=mx.int32))[:, None, :, None]
        for store in (self.keys, self.values):
            for layer, a in enumerate(store):
                if a is None:
                    continue
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
        rows of that shape; keys and values follow any tree. Asked before a step is traced."""

    def restorable(self, length: int) -> int:
        """The longest prefix of at most `length` slots that `truncate` can return to."""
        return length if self.codec is None or length >= self.codec.start else 0

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
