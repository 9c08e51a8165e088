"""The cache of a hybrid model: keys/values for its attention layers (a `KVCache`) and, for its
recurrent layers (Gated DeltaNet), the causal-conv inputs and the delta-rule state, kept per
row of the last forward so that speculative rollback restores them exactly.

A recurrent layer's state after slot t cannot be recomputed from the cache the way attention
re-reads keys: rolling a rejected draft back needs the state at the accepted prefix. So a
forward of at most `ROWS` tokens keeps the state entering it and the state after each of its
rows (`ring`), and the conv inputs those states read (`conv`); `base` (on the device) is the
slot of the ring's first state. The next forward, starting at slot `start`, gathers row
`start - base` on the device: after a verify where n + 1 of k + 1 rows were accepted the loop
truncates to root + n + 1 and the next forward reads that row, with no host sync, also when the
start is lazy (a step queued before the last one was read). A longer forward (a prefill chunk)
keeps its final state only.

`truncate(length)` therefore restores only lengths the ring holds (from the last forward's
first slot to its last) or 0 (a fresh state); anything else is a ValueError, and
`restorable(length)` tells the prompt-prefix reuse how far it may go back (sequence.py). A
`checkpoint` copies out the state at one slot (the prompt's end but its last token, which a
prefill runs alone to that end), so that a prompt repeating the last one returns there.
Trees are refused by the models (a tree's rows do not form one sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from .cache import Checkpoint, KVCache


def chains_only(model_type: str) -> str:
    """The one-line refusal of a tree on a hybrid target, naming the chain settings to use."""
    return (
        f"{model_type} targets verify chains only (their recurrent layers cannot follow a "
        "tree): use a draft model, native MTP (--mtp), prompt lookup with --lookup-branches 1 "
        "(lookup_branches=1) or EAGLE with --tree-top-k 1; Medusa trees are not supported"
    )


ROWS = 64  # a forward of at most this many tokens keeps its per-row states (BUCKETS[-1])


def keeps_every(rows: int) -> bool:
    """Whether a step's forward of `rows` tokens keeps the recurrent state after each, for a
    rollback to any: up to ROWS, but not a lone token's, which is always committed (a plain
    step), so its final state is the only one it needs (a batch's plain steps copy no more)."""
    return 1 < rows <= ROWS


@dataclass(frozen=True)
class RecurrentShape:
    """One recurrent layer's state: conv over `channels` with a `kernel`-wide window, and a
    (heads, key_dim, value_dim) delta-rule state (always float32, as transformers keeps it)."""

    channels: int
    kernel: int
    heads: int
    key_dim: int
    value_dim: int


class HybridCache(KVCache):
    """`KVCache` over the attention layers plus the recurrent layers' rings. `linear[i]` says
    whether layer i (of this process) is recurrent; attention layers write through `write` by
    their model index, mapped to their slot among the attention layers."""

    follows_trees = False  # a recurrent state follows one path: chains only

    def __init__(
        self,
        linear: Sequence[bool],
        shape: RecurrentShape,
        model_type: str,
        step: int = 256,
        like: mx.array | None = None,
    ):
        self.linear = tuple(linear)
        super().__init__(self.linear.count(False), step, like)
        self.shape = shape
        self.model_type = model_type
        self.like = like  # batch and dtype, also where no attention layer has a `likes` entry
        self._kv = {i: n for n, i in enumerate(i for i, r in enumerate(linear) if not r)}
        self._rec = {i: n for n, i in enumerate(i for i, r in enumerate(linear) if r)}
        count = len(self._rec)
        self.conv: list[mx.array | None] = [None] * count  # (B, kernel - 1 + rows, channels)
        self.ring: list[mx.array | None] = [None] * count  # (rows + 1, B, H, Dk, Dv)
        self.base = mx.array(0, dtype=mx.int32)  # slot of ring row 0
        self._next_base: mx.array | None = None  # set by a forward, taken by `advance`
        self._kept = (0, 0)  # host: the slots whose state the ring holds (first, last)
        self._every: bool | None = None  # set by `keep`: whether it kept every row's state
        # The states at the marked slot (`mark`), by recurrent layer, and that slot.
        self._marked: list[tuple[mx.array, mx.array] | None] = [None] * count
        self._marked_at: list[int] | None = None

    # Attention layers.
    def write(self, layer, keys, values, start, end):
        return super().write(self._kv[layer], keys, values, start, end)

    # Recurrent layers.
    def recurrent(self, layer: int, start: mx.array, batch: int, dtype: mx.Dtype):
        """The conv window (B, kernel - 1, channels) and delta-rule state (B, H, Dk, Dv) at
        slot `start` (an int32 array): the ring's row start - base, gathered on the device."""
        r, s = self._rec[layer], self.shape
        if self.conv[r] is None:
            conv = mx.zeros((batch, s.kernel - 1, s.channels), dtype)
            return conv, mx.zeros((batch, s.heads, s.key_dim, s.value_dim), mx.float32)
        rows = self.ring[r].shape[0]
        row = mx.clip(start - self.base, 0, rows - 1)
        window = mx.take(self.conv[r], row + mx.arange(s.kernel - 1), axis=1)
        return window, mx.take(self.ring[r], row[None], axis=0)[0]

    def keep(self, layer: int, start: mx.array, conv: mx.array, states: list[mx.array]) -> None:
        """A forward from slot `start` read `conv` (B, kernel - 1 + L, channels: its entering
        window, then its L inputs) and produced `states` (the entering one and one per row,
        or, past ROWS rows, the final one alone)."""
        r, length = self._rec[layer], conv.shape[1] - (self.shape.kernel - 1)
        self._every = len(states) == length + 1
        if self._every:
            self.conv[r], self.ring[r] = conv, mx.stack(states)
            self._next_base = start
        else:
            self.conv[r] = conv[:, length:]
            self.ring[r] = states[-1][None]
            self._next_base = start + length

    def mark(self, slots: list[int] | None) -> None:
        super().mark(slots)
        self._marked, self._marked_at = [None] * len(self._marked), slots

    def keep_marked(self, layer: int, window: mx.array, state: mx.array) -> None:
        """The conv window and delta-rule state at the marked slot (`mark`), from a forward."""
        self._marked[self._rec[layer]] = (window, state)

    def as_after(self, base: int, rows: int, length: int) -> None:
        """The cache as after a forward of `rows` rows from slot `base` that kept the state
        after each (its rings and conv inputs already in place: a prompt-cache file's), then
        taken back to `length` slots."""
        self.base = mx.array(base, mx.int32)
        self.offset = base
        self._every = True
        self.advance(rows)
        self.truncate(length)

    def restore(
        self, length: int, windows: dict[int, mx.array], states: dict[int, mx.array]
    ) -> None:
        """The recurrent layers' state at `length` tokens, which the attention layers hold:
        by model layer, the conv window (1, kernel - 1, channels) and delta-rule state (1, H,
        Dk, Dv) of a sequence that decoded in a batch row, handed back (batch/cache.py)."""
        for layer, r in self._rec.items():
            self.conv[r], self.ring[r] = windows[layer], states[layer][None]
        self.base = mx.array(length, dtype=mx.int32)
        self._next_base, self._every, self._kept = None, None, (length, length)

    def checkpoint(self, length: int) -> Checkpoint | None:
        """The recurrent layers' state at `length` (a conv window and a delta-rule state each,
        copied out, so the ring they came from can go), while the last forward's rows hold it
        or the forward kept it at a marked slot (`mark`)."""
        if length == 0:
            return None
        if self.restorable(length) == length:
            at = mx.array(length, mx.int32)
            dtype = mx.float32 if self.like is None else self.like.dtype
            states = {layer: self.recurrent(layer, at, 1, dtype) for layer in self._rec}
        elif self._marked_at == [length] and all(m is not None for m in self._marked):
            states = {layer: self._marked[r] for layer, r in self._rec.items()}
        else:
            return None
        mx.eval(states)
        none = (None,) * len(self.keys)  # no rings among its attention layers
        return Checkpoint(length, self.high, none, none, self.codec, states)

    def return_to(self, checkpoint: Checkpoint) -> None:
        super().return_to(checkpoint)
        states = checkpoint.recurrent
        self.restore(
            checkpoint.length,
            {layer: window for layer, (window, _) in states.items()},
            {layer: state for layer, (_, state) in states.items()},
        )

    # The loop's interface.
    def check_verify(self, rows: int, is_chain: bool) -> None:
        if not is_chain:
            raise ValueError(chains_only(self.model_type))
        if rows > ROWS:
            raise ValueError(f"recurrent layers verify at most {ROWS} rows at once, got {rows}")

    def advance(self, length: int) -> None:
        if self._next_base is not None:
            self.base, self._next_base = self._next_base, None
        # What the forward kept (`keep`); a step's view kept it, where the cache only advances
        # past the step (its rows, at most ROWS, each with its state).
        every = keeps_every(length) if self._every is None else self._every
        self._every = None
        first = self.offset if every else self.offset + length
        self._kept = (first, self.offset + length)
        super().advance(length)

    def restorable(self, length: int) -> int:
        return super().restorable(length) if length >= self._kept[0] or length == 0 else 0

    def truncate(self, length: int) -> None:
        """As `KVCache.truncate`, where the recurrent state can be restored: within the last
        forward's kept rows, or 0 (a fresh state); else a ValueError, and nothing changes."""
        if length == self.offset:
            return
        first, last = self._kept
        if length != 0 and not first <= length <= last:
            raise ValueError(
                f"cannot restore the recurrent state at {length} tokens: only {first} to "
                f"{last} (the last forward's rows) are kept"
            )
        super().truncate(length)
        if length == 0:  # a fresh state, in storage of the same shapes (compiled steps keep theirs)
            window = self.shape.kernel - 1
            self.conv = [None if a is None else mx.zeros_like(a[:, :window]) for a in self.conv]
            self.ring = [None if a is None else mx.zeros_like(a[:1]) for a in self.ring]
            self.base, self._kept = mx.array(0, dtype=mx.int32), (0, 0)

    @property
    def state(self) -> list[mx.array]:
        recurrent = [a for a in self.conv + self.ring if a is not None]
        return super().state + recurrent + [self.base]

    def set_arrays(self, arrays: Sequence[mx.array]) -> None:
        arrays = list(arrays)
        kv = len(super().state)
        super().set_arrays(arrays[:kv])
        it = iter(arrays[kv:-1])
        self.conv = [None if a is None else next(it) for a in self.conv]
        self.ring = [None if a is None else next(it) for a in self.ring]
        self.base = arrays[-1]

    def adopt(self, arrays: Sequence[mx.array]) -> None:
        count = 2 * (len(self.keys) + len(self.conv)) + 1
        if len(arrays) != count:
            raise ValueError(f"a hybrid cache view needs all {count} arrays, got {len(arrays)}")
        kv = 2 * len(self.keys)
        super().adopt(arrays[:kv])
        rec = len(self.conv)
        self.conv = list(arrays[kv : kv + rec])
        self.ring = list(arrays[kv + rec : kv + 2 * rec])
        self.base = arrays[-1]

    def reserve(self, length: int) -> None:
        super().reserve(length)
        like = self.like
        if like is not None:
            s, batch = self.shape, like.shape[0]
            for r, conv in enumerate(self.conv):
                if conv is None:
                    self.conv[r] = mx.zeros((batch, s.kernel - 1, s.channels), like.dtype)
                    ring = mx.zeros((1, batch, s.heads, s.key_dim, s.value_dim), mx.float32)
                    self.ring[r] = ring
