"""Preallocated key/value cache: in-place writes, O(1) truncation, accepted-path compaction.

Every layer shares one `offset`: the number of committed slots. A forward writes its L new
keys at `offset` in every layer and then `advance(L)` moves the offset past them; rejected
speculation is undone by `truncate`, and a verified tree path is moved into consecutive slots by
`compact`. Storage grows in `step`-sized chunks (one copy per chunk, never a concatenate per
token).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


class KVCache:
    def __init__(self, num_layers: int, step: int = 256):
        self.step = step
        self.offset = 0
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers

    @property
    def capacity(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def _reserve(self, layer: int, keys: mx.array, values: mx.array, length: int) -> None:
        """Makes room for `length` slots in `layer`, copying what is committed."""
        current_k, current_v = self.keys[layer], self.values[layer]
        if current_k is not None and current_k.shape[2] >= length:
            return
        capacity = -(-length // self.step) * self.step
        B, H, _, Dk = keys.shape
        new_k = mx.zeros((B, H, capacity, Dk), keys.dtype)  # (B, H_kv, capacity, D)
        new_v = mx.zeros((B, H, capacity, values.shape[-1]), values.dtype)
        if current_k is not None and self.offset > 0:
            new_k[..., : self.offset, :] = current_k[..., : self.offset, :]
            new_v[..., : self.offset, :] = current_v[..., : self.offset, :]
        self.keys[layer], self.values[layer] = new_k, new_v

    def update(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Writes (B, H_kv, L, D) keys/values at `offset`; returns all slots up to offset + L."""
        end = self.offset + keys.shape[2]
        self._reserve(layer, keys, values, end)
        self.keys[layer][..., self.offset : end, :] = keys
        self.values[layer][..., self.offset : end, :] = values
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def advance(self, length: int) -> None:
        self.offset += length

    def truncate(self, length: int) -> None:
        """Drops every slot from `length` on (the storage stays; O(1))."""
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot truncate a cache of {self.offset} slots to {length}")
        self.offset = length

    def compact(self, start: int, slots: Sequence[int]) -> None:
        """Moves `slots` (strictly ascending, all >= start) to start, start+1, ...; the rest is
        dropped.

        Used after tree verification: the accepted path's keys were written at scattered slots.
        """
        slots = list(slots)
        if any(s < start or s >= self.offset for s in slots) or slots != sorted(set(slots)):
            raise ValueError(
                f"slots {slots} are not strictly ascending within [{start}, {self.offset})"
            )
        end = start + len(slots)
        if slots != list(range(start, end)):
            index = mx.array(slots)
            for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
                if k is None:
                    continue
                k[..., start:end, :] = k[..., index, :]
                v[..., start:end, :] = v[..., index, :]
                self.keys[layer], self.values[layer] = k, v
        self.offset = end

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate together with a step's outputs."""
        return [a for a in self.keys + self.values if a is not None]
