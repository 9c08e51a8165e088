"""How a prompt's prefill is cut into chunks, and how it is cancelled between them.

A prompt runs into the cache in chunks, each evaluated before the next is built, so that a
prefill can stop between them: a server's when its client leaves (a `cancelled` callback), the
CLI's on Ctrl-C. Without a callback chunks are PREFILL_STEP tokens; with one, each is sized by
the last one's time to about CANCEL_SECONDS, so that a client who leaves holds the model that
long at most on a slow machine: powers of two from CANCELLABLE_STEPS[0] to PREFILL_STEP,
starting at CANCELLABLE_STEPS[1].
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

PREFILL_STEP = 256  # tokens per prefill chunk: short enough to cancel between
CANCEL_SECONDS = 0.5
CANCELLABLE_STEPS = (16, 32)  # the least, and the first


class PrefillCancelled(Exception):
    """The `cancelled` callback of a prefill asked it to stop."""


def chunks(
    start: int, end: int, cancelled: Callable[[], bool] | None = None
) -> Iterator[tuple[int, int]]:
    """The (start, stop) of each chunk of the prompt positions `start .. end - 1`, in order.
    Before each, asks `cancelled` and raises PrefillCancelled when it says so; with it, sizes
    each chunk after the first by the time the caller took over the one before (from the
    yield to the next request), which is that chunk's forward and its sync."""
    step = PREFILL_STEP if cancelled is None else CANCELLABLE_STEPS[1]
    while start < end:
        if cancelled is not None and cancelled():
            raise PrefillCancelled(f"cancelled at {start} of {end} prompt tokens")
        stop = min(start + step, end)
        began = time.perf_counter()
        yield start, stop
        if cancelled is not None:
            step = cancellable_step(stop - start, time.perf_counter() - began)
        start = stop


def cancellable_step(tokens: int, seconds: float) -> int:
    """The next chunk's size after a chunk of `tokens` took `seconds`: the power of two that
    fits in CANCEL_SECONDS at that rate, within CANCELLABLE_STEPS[0] and PREFILL_STEP."""
    fit = max(1, int(tokens * CANCEL_SECONDS / max(seconds, 1e-9)))
    return max(CANCELLABLE_STEPS[0], min(PREFILL_STEP, 1 << (fit.bit_length() - 1)))
