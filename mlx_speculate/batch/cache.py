"""The batch's key/value cache: one row per sequence, each with its own committed length.

Row b holds its sequence's keys at slots 0 .. offsets[b] - 1, in position order, exactly as a
single sequence's `KVCache` does; a batch forward writes each row's new keys at that row's own
slot (`start`, a (B,) array), so sequences of any lengths share one forward, and a row's slots
past its offset (rejected drafts) are overwritten by its next step, never seen (the mask of
models/context.py hides every slot at or past a row's start but its own new ones).

The engine sets `start` and `attended` before each forward and keeps the offsets on the host;
the forward's `advance` leaves them alone. Rows move in and out between forwards: a sequence's
prefilled prompt comes in from its own cache (`insert`), its whole context goes back there
when it leaves (`extract`), so the prompt-prefix cache and sessions work as they do alone.

Memory: the storage is `rows` x the longest row's slots (rounded up to the step). What leaves
is copied out and evaluated at once, and a shrinking batch copies the rows it keeps, so no
lazy slice keeps the whole batch's storage alive; a cache that no sequence holds keeps none.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..cache import KVCache


class BatchKVCache(KVCache):
    def __init__(self, shapes: Sequence[tuple[int, int]], dtype: mx.Dtype, rows: int):
        """`shapes`: (key/value heads, head size) of each layer (`CausalLM.kv_shapes`)."""
        likes = [mx.zeros((rows, heads, 0, size), dtype) for heads, size in shapes]
        super().__init__(len(likes), like=likes)
        self.rows = rows
        self.offsets = [0] * rows

    def write(
        self, layer: int, keys: mx.array, values: mx.array, start: mx.array, end: int | None
    ) -> tuple[mx.array, mx.array]:
        """Writes row b's (H_kv, L, D) keys/values at its slot start[b]; returns the whole
        storage. The engine reserved the room (`prepare`)."""
        B, H, L, D = keys.shape
        slots = (start[:, None] + mx.arange(L, dtype=mx.int32))[:, None, :, None]  # (B, 1, L, 1)
        k, v = self.keys[layer], self.values[layer]
        k = mx.put_along_axis(k, mx.broadcast_to(slots, keys.shape), keys, axis=2)
        v = mx.put_along_axis(v, mx.broadcast_to(slots, values.shape), values, axis=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def advance(self, length: int) -> None:
        """A forward's own advance: the engine moves each row's offset once it has read how
        many of the row's new slots it accepted."""

    def prepare(self, rows: int) -> mx.array:
        """Room for a forward of `rows` new tokens per row; its start slots, (B,) int32.
        Attention reads the leading slots up to the longest row's end (`KVCache.span`)."""
        end = max(self.offsets) + rows
        self.reserve(end)
        self.attended = self.span(end)
        self.start = mx.array(self.offsets, dtype=mx.int32)
        return self.start

    def insert(self, row: int, source: KVCache, length: int) -> None:
        """Row `row` takes the first `length` slots of a one-sequence cache."""
        self.reserve(length)
        at = mx.array([row, 0], dtype=mx.int32)
        for layer, (k, v) in enumerate(zip(source.keys, source.values, strict=True)):
            if k is None or length == 0:
                continue
            self.keys[layer] = mx.slice_update(self.keys[layer], k[..., :length, :], at, (0, 2))
            self.values[layer] = mx.slice_update(self.values[layer], v[..., :length, :], at, (0, 2))
        self.offsets[row] = length

    def extract(self, row: int, target: KVCache, length: int) -> None:
        """A one-sequence cache takes row `row`'s first `length` slots (its own storage,
        evaluated now: a lazy slice would keep the batch's whole storage alive), its offset
        set to `length`; the row is then free (offset 0)."""
        size = min(self.capacity, target.capacity_for(length))
        copies = []
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is not None:
                target.keys[layer] = mx.array(k[row : row + 1, :, :size, :])
                target.values[layer] = mx.array(v[row : row + 1, :, :size, :])
                copies += [target.keys[layer], target.values[layer]]
        mx.eval(copies)
        target.offset = length
        self.offsets[row] = 0
        if not any(self.offsets):  # no sequence holds a row: the storage goes back
            self.keys = [None] * len(self.keys)
            self.values = [None] * len(self.values)

    def move(self, source: int, destination: int) -> None:
        """Row `destination` takes row `source`'s slots and offset (a sequence left)."""
        at = mx.array([destination, 0], dtype=mx.int32)
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is not None:
                self.keys[layer] = mx.slice_update(k, k[source : source + 1], at, (0, 2))
                self.values[layer] = mx.slice_update(v, v[source : source + 1], at, (0, 2))
        self.offsets[destination] = self.offsets[source]
        self.offsets[source] = 0

    def resize(self, rows: int) -> None:
        """`rows` rows: the leading ones kept (a batch grows or shrinks by whole buckets). A
        shrinking cache copies what it keeps, its slots cut to the kept rows' longest."""
        offsets = (self.offsets + [0] * rows)[:rows]
        slots = -(-max(offsets) // self.step) * self.step
        kept = []
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            like = self.likes[layer]
            self.likes[layer] = mx.zeros((rows, *like.shape[1:]), like.dtype)
            if k is None:
                continue
            if rows > self.rows:
                self.keys[layer] = mx.concatenate(
                    [k, mx.zeros((rows - self.rows, *k.shape[1:]), k.dtype)]
                )
                self.values[layer] = mx.concatenate(
                    [v, mx.zeros((rows - self.rows, *v.shape[1:]), v.dtype)]
                )
            elif slots == 0:
                self.keys[layer] = self.values[layer] = None
            else:
                self.keys[layer] = mx.array(k[:rows, :, :slots])
                self.values[layer] = mx.array(v[:rows, :, :slots])
                kept += [self.keys[layer], self.values[layer]]
        mx.eval(kept)
        self.offsets = offsets
        self.rows = rows
