"""The target's features of committed positions, as a head drafter (EAGLE, MTP, DFlash) takes
them in: `extend` hands their rows over each step, but the head runs them only at the next
proposal, all at once, so the rows wait until then. `FeatureQueue` keeps the split between the
positions whose keys and values the head's cache holds and the rows still waiting after them,
and rewinds both: kept in one place because an off-by-one in either drafts from a stale state.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache import KVCache


class FeatureQueue:
    """Committed positions `0 .. fed - 1` are in the head's `cache`; the feature rows of
    `fed .. known - 1` wait (`rows`) for the head to run them."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.fed = 0  # committed positions in the head's cache
        self.known = 0  # committed positions whose features it has: fed + waiting
        self._rows: list[mx.array] = []  # (n > 0, F) each, in position order

    @property
    def waiting(self) -> int:
        """Committed positions whose rows the head has not run."""
        return self.known - self.fed

    def add(self, rows: mx.array) -> None:
        """The rows (n, F) of the next n committed positions."""
        if rows.shape[0]:
            self._rows.append(rows)
            self.known += rows.shape[0]

    def rows(self) -> mx.array | None:
        """The waiting rows (waiting, F), or None when none wait."""
        return mx.concatenate(self._rows) if self._rows else None

    def mark_fed(self, length: int) -> None:
        """The head's cache now holds the first `length` committed positions, every row handed
        over included."""
        self.fed = self.known = length
        self._rows = []

    def rewind(self, length: int) -> bool:
        """Only the first `length` positions are still committed: drops the rows past them, or
        the cache's slots past them. True when slots were dropped, so that whatever the head
        computed at its last fed position is stale."""
        if length >= self.known:
            return False
        self.known = length
        if length >= self.fed:
            rows = mx.concatenate(self._rows)[: length - self.fed]
            self._rows = [rows] if rows.shape[0] else []
            return False
        self.cache.truncate(min(self.cache.offset, length))
        self.fed, self._rows = length, []
        return True
