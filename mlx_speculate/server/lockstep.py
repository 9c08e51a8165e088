"""A server whose target is sharded over an `mx.distributed` group (`mlx.launch`): rank 0
owns HTTP, every rank runs the same generations in the same order, in step.

Rank 0's worker thread shares each request it takes (prompt ids, sampling settings with a seed
it fixed, method, draft length, stop strings, grammar) with one broadcast; the other ranks wait
for it on their main thread and run the same generation, whose output they drop. Decoding is
deterministic from those parameters (distributed.py), so the ranks agree on every token without
sending any; what is not deterministic is rank 0's to decide and is broadcast as one flag per
token and per prefill chunk (`agree`): its client went away, it was cancelled, or rank 0 failed
to deliver a token. A `None` request ends the followers (the server shut down).

A peer lost during a collective raises ConnectionError (ranks.guarded); a peer that hangs ends
this rank through the watchdog, armed from a shared request to the end of its generation and
paused while the ranks wait for the next request.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ..device import GENERATION_STREAM
from ..parallel.group import from_rank0, rank0_says
from ..parallel.ranks import Watchdog, guarded, lost_peer
from .records import Event, Generation


class Solo:
    """A server alone on its machine: nothing to share, its own flags decide."""

    leads = True

    @contextmanager
    def guard(self) -> Iterator[None]:
        yield

    def share(self, request: Generation | None) -> Generation | None:
        return request

    def agree(self, flag: bool) -> bool:
        return flag

    def lost(self, error: Exception) -> bool:
        return False

    def idle(self) -> None:
        pass


class Lockstep:
    """Rank `group.rank()` of a sharded server (`leads` on rank 0). Every method is a
    collective (or arms the watchdog) and must be called in the same order on every rank."""

    def __init__(self, group: mx.distributed.Group, timeout: float):
        self.group = group
        self.timeout = timeout
        self.leads = group.rank() == 0
        self._watchdog: Watchdog | None = None

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Holds the watchdog; a lost peer inside raises ConnectionError (one line)."""
        with guarded(self.group, self.timeout) as watchdog:
            self._watchdog = watchdog
            yield

    def share(self, request: Generation | None) -> Generation | None:
        """Rank 0 passes its next request (None: stop), with the seed fixed when it has none;
        every rank gets rank 0's. Two all-sums on the generation stream (distributed.from_rank0
        says why): the pickle's length, then its bytes."""
        if self.leads:
            self._watchdog.beat()  # the followers are waiting: they must answer now
            if request is not None and request.sampling.seed is None:
                seed = int(np.random.default_rng().integers(2**31))
                request = replace(request, sampling=replace(request.sampling, seed=seed))
            payload = pickle.dumps(request)
        else:
            self._watchdog.pause()  # rank 0 may wait for a client for as long as it likes
            payload = b""
        data = np.zeros(from_rank0(len(payload), self.group), np.uint8)
        data[: len(payload)] = np.frombuffer(payload, np.uint8)
        data = mx.distributed.all_sum(mx.array(data), group=self.group, stream=GENERATION_STREAM)
        self._watchdog.beat()
        # Only rank 0's bytes are non-zero: the sum is its pickle, from a peer of this run.
        return pickle.loads(memoryview(np.array(data)))

    def agree(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank (one scalar all-sum); a step finished."""
        decided = rank0_says(flag, self.group)
        self._watchdog.beat()
        return decided

    def lost(self, error: Exception) -> bool:
        """Whether `error` means a rank was lost: no generation can run after it."""
        return lost_peer(error)

    def idle(self) -> None:
        """Loading or a generation ended: waiting is expected until the next share."""
        self._watchdog.pause()


class Mirror:
    """Rank 0's job as a follower rank runs it: the same request, its events dropped; only
    rank 0's flag cancels it (through `agree`)."""

    cancelled = False

    def __init__(self, request: Generation):
        self.request = request
        self.submitted = time.perf_counter()

    def cancel(self) -> None:
        pass

    def emit(self, event: Event) -> None:
        pass
