"""The target's features of committed positions, as a head drafter (EAGLE, MTP, DFlash) takes
them in: `extend` hands their rows over each step, but the head runs them only at the next
proposal, all at once, so the rows wait until then. `FeatureQueue` keeps the split between the
positions whose keys and values the head's cache holds and the rows still waiting after them,
and rewinds both: kept in one place because an off-by-one in either drafts from a stale state.
`FusedSteps` keeps, over that queue, what a fused drafter's steps leave between them.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache import KVCache
from .base import Draft


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


class FusedSteps:
    """What a fused drafter (EAGLE, MTP, DFlash: `FusedDrafter`) keeps between the verify
    steps that drafted for it. Each fused step's graph writes the verified path's rows into
    the head's cache from the fed positions' end and drafts the next proposal after them;
    until the loop reads the step's accepted count (`settle`), that step is `queued` with its
    lazy entry (a drafter's own state and its `Draft`). After it settles, its entry is
    `ready` for the next proposal, unless a step queued on its lazy count (`follow`) took
    the draft already. Kept in one place because a slot off by one drafts from a stale state.
    """

    def __init__(self, features: FeatureQueue):
        self.features = features
        self.queued: list[tuple[object, Draft]] = []  # oldest first
        self.ready: tuple[object, Draft] | None = None
        # After `follow`: the slot the next fused step's path starts at (lazy), a host bound.
        self._start: tuple[mx.array, int] | None = None

    def rewind(self, length: int) -> bool:
        """`FeatureQueue.rewind`; unsettled steps wrote past the fed slots, so they are dropped,
        and the ready entry too when positions it followed are no longer committed."""
        self.queued, self._start = [], None
        if length < self.features.known:
            self.ready = None
        return self.features.rewind(length)

    def take_ready(self) -> tuple[object, Draft] | None:
        """The settled step's entry, once: a proposal either uses it or drafts anew."""
        ready, self.ready = self.ready, None
        return ready

    def path_start(self) -> tuple[mx.array, int] | None:
        """Where the next fused step's path starts (a lazy slot and a host bound on it): after
        `follow`, after the followed step's accepted drafts; else at the fed positions' end,
        or None when a step not followed is still queued (its slots are not known)."""
        start, self._start = self._start, None
        if start is not None:
            return start
        if self.queued:
            return None
        return mx.array(self.features.fed, mx.int32), self.features.fed

    def received(self, state: object, draft: Draft) -> None:
        """A fused step was queued: its lazy entry."""
        self.queued.append((state, draft))

    def sole(self) -> tuple[object, Draft] | None:
        """The entry of the one unsettled step, which a step queued on its count may follow;
        None when there is not exactly one, or rows wait outside the fused path."""
        if len(self.queued) != 1 or self.features.waiting:
            return None
        return self.queued[0]

    def follow(self, accepted: mx.array, most: int) -> None:
        """The next fused step follows the sole queued one, which accepted `accepted` (lazy,
        at most `most`) drafts: its path starts after them and that step's root."""
        fed = self.features.fed
        self._start = (fed + 1 + accepted, fed + 1 + most)

    def settle(self, accepted: int) -> tuple[object, Draft]:
        """The oldest queued step accepted `accepted` drafts: the head's cache holds its path
        up to them and the root; returns its entry."""
        entry = self.queued.pop(0)
        fed = self.features.fed + accepted + 1
        self.features.mark_fed(fed)
        self.ready = None if self.queued else entry
        cache = self.features.cache
        cache.truncate(min(cache.offset, fed))
        cache.advance(fed - cache.offset)
        return entry
