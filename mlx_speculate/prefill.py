"""How a prompt's prefill runs: in chunks, each evaluated before the next is built, so that a
prefill can stop between them (a server's when its client leaves, the CLI's on Ctrl-C) and a
batch's running sequences can step between them (batch/engine.py). Chunks are PREFILL_STEP
tokens, or, sized (a cancellable prefill's, a batch's), each sized by the last one's time to
about CANCEL_SECONDS, so that a client who leaves holds the model that long at most on a slow
machine: powers of two from CANCELLABLE_STEPS[0] to PREFILL_STEP, from CANCELLABLE_STEPS[1].
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import mlx.core as mx

from .device import GENERATION_STREAM
from .drafters.base import TargetFeatures
from .models.quantized_prefill import prefilling

if TYPE_CHECKING:
    from .decode import Decoder

PREFILL_STEP = 256  # tokens per prefill chunk: short enough to cancel between
CANCEL_SECONDS = 0.5
CANCELLABLE_STEPS = (16, 32)  # the least, and the first


class PrefillCancelled(Exception):
    """The `cancelled` callback of a prefill asked it to stop."""


def cancellable_step(tokens: int, seconds: float) -> int:
    """The next chunk's size after a chunk of `tokens` took `seconds`: the power of two that
    fits in CANCEL_SECONDS at that rate, within CANCELLABLE_STEPS[0] and PREFILL_STEP."""
    fit = max(1, int(tokens * CANCEL_SECONDS / max(seconds, 1e-9)))
    return max(CANCELLABLE_STEPS[0], min(PREFILL_STEP, 1 << (fit.bit_length() - 1)))


class Prefill:
    """A prompt's prefill in chunks (`Decoder.begin_prefill`): each `chunk` runs the next
    chunk into the cache and its features into the drafter, evaluated before it returns; the
    last one keeps the logits of the prompt's last position for the first token."""

    def __init__(self, decoder: Decoder, prompt: list[int], kept: int, sized: bool):
        self.decoder, self.prompt, self.kept, self.start = decoder, prompt, kept, kept
        self._sized = sized
        self._size = CANCELLABLE_STEPS[1] if sized else PREFILL_STEP

    @property
    def done(self) -> bool:
        return self.start >= len(self.prompt)

    def chunk(self) -> None:
        decoder = self.decoder
        chunk = self.prompt[self.start : self.start + self._size]
        began = time.perf_counter()
        with mx.stream(GENERATION_STREAM), prefilling():  # a head drafter's own forward too
            out = decoder.model(mx.array([chunk]), decoder.cache, taps=decoder.taps)
            if decoder.drafter is not None:
                hidden, taps = out.hidden[0], tuple(t[0] for t in out.taps)
                decoder.drafter.extend(TargetFeatures(hidden, taps))
            mx.eval(decoder.cache.state)
            self.start += len(chunk)
            decoder.context = self.prompt[: self.start]
            if self._sized:
                self._size = cancellable_step(len(chunk), time.perf_counter() - began)
            if self.done:
                # Only the last row is projected (the prefill's own logits are never evaluated).
                decoder._prompt_logits = decoder.model.project(out.hidden[0, -1:])
