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

from ..cache import RING_ROWS, Checkpoint, KVCache
from ..state_cache import HybridCache


class BatchKVCache(KVCache):
    def __init__(
        self,
        shapes: Sequence[tuple[int, int]],
        dtype: mx.Dtype,
        rows: int,
        window: int | None = None,
        sliding: Sequence[bool] = (),
    ):
        """`shapes`: (key/value heads, head size) of each layer (`CausalLM.kv_shapes`);
        `window`, `sliding`: its sliding layers, kept as rings (`CausalLM.kv_window`)."""
        likes = [mx.zeros((rows, heads, 0, size), dtype) for heads, size in shapes]
        super().__init__(len(likes), like=likes, window=window, sliding=sliding)
        self.shapes, self.dtype = list(shapes), dtype
        self.sliding = tuple(sliding)
        self.rows = rows
        self.offsets = [0] * rows

    @classmethod
    def of(cls, model, rows: int) -> BatchKVCache:
        """The batch cache of `model`'s layers (a `CausalLM`): key/value rows, and a hybrid's
        recurrent state per row (a `BatchHybridCache`)."""
        if model.recurrent:
            return BatchHybridCache(model.make_cache(), rows)
        return cls(model.kv_shapes(), model.compute_dtype, rows, **model.kv_window())

    def fresh(self) -> BatchKVCache:
        """An empty cache of the same layers and rows: a compiled forward's view adopts the
        cache's arrays into one (batch/step.py)."""
        return BatchKVCache(self.shapes, self.dtype, self.rows, self.window, self.sliding)

    def _put(
        self, layer: int, keys: mx.array, values: mx.array, start: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Writes row b's (H_kv, L, D) keys/values at its slot start[b]; returns the whole
        storage. The engine reserved the room (`prepare`)."""
        B, H, L, D = keys.shape
        k, v = self.keys[layer], self.values[layer]
        if self.rings[layer] is not None and k.shape[2] == self.rings[layer]:
            slots = self.ring_columns(start, L)  # a full ring: slot j at column j mod R
        else:
            slots = (start[:, None] + mx.arange(L, dtype=mx.int32))[:, None, :, None]
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
        # What the row's rings hold: its steps wrote at most a verify's rows past its length.
        target.high = length + (0 if self.ring_size is None else RING_ROWS // 2)
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


class BatchHybridCache(BatchKVCache):
    """The batch's cache of a hybrid target: `BatchKVCache` rows for its attention layers and,
    for its recurrent layers, each row's conv window and delta-rule state kept per verify row
    as a one-sequence `HybridCache` keeps them (state_cache.py), with a start slot `base` per
    row: row b's next forward, from its own start, gathers its ring row start[b] - base[b], so
    each sequence rolls back to its own accepted count on the device, no host sync.

    Chains only (`check_verify`), at most ROWS rows a forward. A padded prefill of several
    prompts (`lengths` set) keeps each row's state at its own length: its padding neither
    decays nor writes the state (models/gated_delta.py)."""

    def __init__(self, template: HybridCache, rows: int):
        """`template`: a one-sequence cache of the model (`make_cache`), whose layers it takes."""
        shapes = [(like.shape[1], like.shape[3]) for like in template.likes]
        dtype = template.like.dtype
        super().__init__(shapes, dtype, rows)
        self.template = template
        self.linear, self.shape = template.linear, template.shape
        self._kv = {i: n for n, i in enumerate(i for i, r in enumerate(self.linear) if not r)}
        self._rec = {i: n for n, i in enumerate(i for i, r in enumerate(self.linear) if r)}
        s, count = self.shape, len(self._rec)
        # (B, kernel - 1 + L, channels): the last forward's entering windows and inputs
        self.conv = [mx.zeros((rows, s.kernel - 1, s.channels), dtype) for _ in range(count)]
        # (L + 1, B, H, Dk, Dv): the state entering the last forward, then after each row
        shape = (1, rows, s.heads, s.key_dim, s.value_dim)
        self.ring = [mx.zeros(shape, mx.float32) for _ in range(count)]
        self.base = mx.zeros((rows,), mx.int32)  # (B,) slot of each row's ring row 0
        self._next_base: mx.array | None = None
        self._marked: list[tuple[mx.array, mx.array] | None] = [None] * count  # (`mark`)

    def fresh(self) -> BatchHybridCache:
        return BatchHybridCache(self.template, self.rows)

    def write(self, layer, keys, values, start, end):
        return super().write(self._kv[layer], keys, values, start, end)

    def recurrent(self, layer: int, start: mx.array, batch: int, dtype: mx.Dtype):
        """Row b's conv window (B, kernel - 1, channels) and state (B, H, Dk, Dv) at its slot
        start[b]: the ring's row start[b] - base[b]."""
        r, kernel = self._rec[layer], self.shape.kernel
        ring, conv = self.ring[r], self.conv[r]
        if ring.shape[0] == 1 and conv.shape[1] == kernel - 1:
            # The last forward kept each row's final state alone (a plain step's): every row
            # reads ring row 0, so there is nothing to gather.
            return conv.astype(dtype), ring[0]
        row = mx.clip(start - self.base, 0, ring.shape[0] - 1)  # (B,)
        at = (row[:, None] + mx.arange(kernel - 1, dtype=mx.int32))[:, :, None]
        window = mx.take_along_axis(conv, mx.broadcast_to(at, (batch, kernel - 1, 1)), axis=1)
        # Row b's state is ring[row[b], b]: whole (H, Dk, Dv) blocks taken from the flattened
        # (ring row, batch row) axis, not gathered element by element.
        flat = ring.reshape(-1, *ring.shape[2:])  # ((L + 1) * B, H, Dk, Dv)
        state = mx.take(flat, row * ring.shape[1] + mx.arange(batch, dtype=mx.int32), axis=0)
        return window.astype(dtype), state

    def keep(self, layer: int, start: mx.array, conv: mx.array, states: list[mx.array]) -> None:
        """A verify forward from slots `start` read `conv` and produced the entering state and
        one per row; the rows' base moves to `start` once the forward is done (`advance`). A
        forward that kept each row's final state alone (a plain step's, a padded prefill's)
        keeps it and the conv window that ends at the row's length (`lengths` where set), its
        base moving to start + length."""
        r = self._rec[layer]
        length = conv.shape[1] - (self.shape.kernel - 1)
        if len(states) == 1:
            if self.lengths is None:
                self.conv[r], self._next_base = conv[:, length:], start + length
            else:
                at = self.lengths[:, None] + mx.arange(self.shape.kernel - 1, dtype=mx.int32)
                self.conv[r] = mx.take_along_axis(conv, at[..., None], axis=1)
                self._next_base = start + self.lengths
            self.ring[r] = states[0][None]
            return
        if len(states) != length + 1:
            raise ValueError(f"a batch verify keeps every row's state, {len(states)} kept")
        self.conv[r], self.ring[r] = conv, mx.stack(states)
        self._next_base = start

    def advance(self, length: int) -> None:
        if self._next_base is not None:
            self.base, self._next_base = self._next_base, None

    def keep_marked(self, layer: int, window: mx.array, state: mx.array) -> None:
        """Each row's conv window and delta-rule state at its marked slot (`mark`)."""
        self._marked[self._rec[layer]] = (window, state)

    @property
    def follows_trees(self) -> bool:
        return self.template.follows_trees

    def check_verify(self, rows: int, is_chain: bool) -> None:
        self.template.check_verify(rows, is_chain)

    @property
    def state(self) -> list[mx.array]:
        return super().state + self.conv + self.ring + [self.base]

    def set_arrays(self, arrays: Sequence[mx.array]) -> None:
        arrays, kv, rec = list(arrays), len(super().state), len(self.conv)
        super().set_arrays(arrays[:kv])
        self.conv = arrays[kv : kv + rec]
        self.ring = arrays[kv + rec : kv + 2 * rec]
        self.base = arrays[-1]

    def adopt(self, arrays: Sequence[mx.array]) -> None:
        arrays, rec = list(arrays), len(self.conv)
        kv = len(arrays) - 2 * rec - 1
        super().adopt(arrays[:kv])
        self.set_arrays(arrays)

    def insert(self, row: int, source: KVCache, length: int) -> None:
        super().insert(row, source, length)
        for layer, r in self._rec.items():
            window, state = source.recurrent(layer, mx.array(length, mx.int32), 1, self.dtype)
            at = mx.array([row, 0], dtype=mx.int32)
            self.conv[r] = mx.slice_update(self.conv[r], window.astype(self.dtype), at, (0, 1))
            self.ring[r] = mx.slice_update(
                self.ring[r], state[None], mx.array([0, row], mx.int32), (0, 1)
            )
        self.base = mx.slice_update(
            self.base, mx.array([length], mx.int32), mx.array([row], mx.int32), (0,)
        )

    def extract(self, row: int, target: KVCache, length: int) -> None:
        super().extract(row, target, length)
        start = mx.array([length] * self.rows, dtype=mx.int32)
        windows, states = {}, {}
        for layer in self._rec:
            window, state = self.recurrent(layer, start, self.rows, self.dtype)
            windows[layer], states[layer] = window[row : row + 1], state[row : row + 1]
        target.restore(length, windows, states)

    def row_checkpoint(self, row: int, length: int) -> Checkpoint:
        """Row `row`'s recurrent state at its marked slot `length` (`mark`) as a one-sequence
        cache's `Checkpoint` (evaluated, its own arrays): a prefill in a batch takes it before a
        prompt's last token, as `HybridCache.checkpoint` does alone."""
        recurrent = {}
        for layer, r in self._rec.items():
            window, state = self._marked[r]
            recurrent[layer] = (mx.array(window[row : row + 1]), mx.array(state[row : row + 1]))
        mx.eval(recurrent)
        none = (None,) * len(self.template.keys)  # no rings among its attention layers
        return Checkpoint(length, length, none, none, None, recurrent)

    def move(self, source: int, destination: int) -> None:
        super().move(source, destination)
        at = mx.array([destination], dtype=mx.int32)
        for r, (conv, ring) in enumerate(zip(self.conv, self.ring, strict=True)):
            self.conv[r] = mx.slice_update(conv, conv[source : source + 1], at, (0,))
            self.ring[r] = mx.slice_update(ring, ring[:, source : source + 1], at, (1,))
        self.base = mx.slice_update(self.base, self.base[source : source + 1], at, (0,))

    def resize(self, rows: int) -> None:
        old = self.rows
        super().resize(rows)
        if rows <= old:
            self.conv = [c[:rows] for c in self.conv]
            self.ring = [r[:, :rows] for r in self.ring]
            self.base = self.base[:rows]
            return
        more = rows - old
        self.conv = [
            mx.concatenate([c, mx.zeros((more, *c.shape[1:]), c.dtype)]) for c in self.conv
        ]
        self.ring = [
            mx.concatenate([r, mx.zeros((r.shape[0], more, *r.shape[2:]), r.dtype)], axis=1)
            for r in self.ring
        ]
        self.base = mx.concatenate([self.base, mx.zeros((more,), mx.int32)])
