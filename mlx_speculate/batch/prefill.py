"""Joining prompts prefilled together: up to PREFILL_ROWS sequences' next chunks in one forward.

Each member holds a row of the group's own cache (batch/cache.py) from when it joins the group
(its session's cached prefix copied in) until its prompt is done (its row's keys copied back to
its session's cache, where the engine takes them into a decoding row as it does any prefilled
prompt). A step runs every member's next chunk at once, each row at its own slot, padded to the
longest chunk (padding writes past a row's end, which nothing reads and its next chunk
overwrites); each member's `Prefill` takes its rows' features as a chunk run alone would hand
them, and the last chunk's last row gives the first token's logits. mlx-lm's server prefills
up to eight prompts at once the same way.

The chunk a member runs is sized so that a step takes about CANCEL_SECONDS (sequence.py) over
all the group's rows: the running sequences' gap between tokens stays bounded while prompts
join, and a cancelled one holds the model no longer than a chunk alone would. While no sequence
decodes (a burst of requests arrived together), a step of n prompts may take min(n, IDLE_STEPS)
times as long (each member's share stays that of a chunk alone), so that the burst's prompts
prefill in one forward, as mlx-lm's server prefills them.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..drafters.base import TargetFeatures
from ..graphs import eager
from ..models.base import CausalLM
from ..models.quantized_prefill import prefilling
from ..sequence import CANCELLABLE_STEPS, PREFILL_STEP, Prefill, cancellable_step
from .cache import BatchKVCache

PREFILL_ROWS = 8  # prompts prefilled in one forward at most, as mlx-lm's server does
IDLE_STEPS = 4  # the most a step's time, in CANCEL_SECONDS, while no sequence decodes


class PrefillGroup:
    """The prefills under way together (see the module): `add` a prefill, `step` them all."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.members: list[Prefill] = []  # members[i] holds row i of the cache
        self.cache: BatchKVCache | None = None
        self._tokens = CANCELLABLE_STEPS[1]  # rows' tokens a step: sized by the last step

    @property
    def full(self) -> bool:
        return len(self.members) >= PREFILL_ROWS

    def add(self, prefill: Prefill) -> None:
        """Takes `prefill` in: its sequence's cached prefix becomes its row."""
        row = len(self.members)
        if self.cache is None:
            self.cache = BatchKVCache.of(self.model, 1)
        if row >= self.cache.rows:
            self.cache.resize(_bucket(row + 1))
        self.members.append(prefill)
        source = prefill.sequence.cache
        self.cache.insert(row, source, source.offset)

    def remove(self, prefill: Prefill) -> None:
        """Takes `prefill` out (cancelled or failed): the chunks it ran go back to its sequence's
        cache, as a cancelled prefill alone keeps them."""
        if prefill not in self.members:
            return
        self._leave(self.members.index(prefill))

    def clear(self) -> list[Prefill]:
        """Drops every member, their rows unread (a forward that failed); returns them."""
        members, self.members, self.cache = self.members, [], None
        return members

    def step(self, idle: bool = False) -> list[Prefill]:
        """Runs every member's next chunk in one forward; returns the members it finished,
        whose keys are back in their sequences' caches (their first token's logits kept).
        `idle`: no sequence decodes meanwhile (the step may take longer: see the module)."""
        members = self.members
        if not members:
            return []
        began = time.perf_counter()
        budget = self._tokens * (min(IDLE_STEPS, len(members)) if idle else 1)
        size = max(CANCELLABLE_STEPS[0], min(PREFILL_STEP, budget // len(members)))
        chunks = [p.prompt[p.start : p.start + size] for p in members]
        width = max(len(c) for c in chunks)
        tokens = [c + [0] * (width - len(c)) for c in chunks]
        tokens += [[0] * width] * (self.cache.rows - len(members))
        taps = tuple(sorted({t for p in members for t in p.sequence.taps}))
        cache = self.cache
        start = cache.prepare(width)
        positions = start[:, None] + mx.arange(width, dtype=mx.int32)  # (B, width)
        padding = [0] * (cache.rows - len(members))
        cache.lengths = mx.array([len(c) for c in chunks] + padding, dtype=mx.int32)
        reaching = [p.reaches_last(len(c)) for p, c in zip(members, chunks, strict=True)]
        marks = [len(p.prompt) - 1 if r else -1 for p, r in zip(members, reaching, strict=True)]
        cache.mark(marks + [-1] * len(padding))  # a hybrid's checkpoints, taken below
        with prefilling(), eager():  # a head drafter's own forward too
            out = self.model(mx.array(tokens), cache, positions=positions, taps=taps)
            for row, (prefill, chunk) in enumerate(zip(members, chunks, strict=True)):
                index = [taps.index(t) for t in prefill.sequence.taps]
                n = len(chunk)  # its rows, not the padding after them
                own = tuple(out.taps[i][row, :n] for i in index)
                prefill.took(TargetFeatures(out.hidden[row, :n], own))
                cache.offsets[row] += n
            cache.lengths = None
            mx.eval(cache.state)
        for row, (prefill, reached) in enumerate(zip(members, reaching, strict=True)):
            # A hybrid's way back to its prompt's end, before the last token (`Prefill.chunk`).
            if self.model.recurrent and reached:
                last = len(prefill.prompt) - 1
                prefill.sequence.checkpoint(last, cache.row_checkpoint(row, last))
        cache.mark(None)
        self._tokens = len(members) * cancellable_step(
            width, (time.perf_counter() - began) / len(members)
        )
        done = [p for p in members if p.done]
        for prefill in done:
            self._leave(members.index(prefill))
        return done

    def _leave(self, row: int) -> None:
        """Row `row`'s keys back to its sequence's cache; the last row moves into its place."""
        cache, prefill = self.cache, self.members[row]
        cache.extract(row, prefill.sequence.cache, cache.offsets[row])
        mx.eval(prefill.sequence.cache.state)  # its own arrays, not views of the group's
        if prefill.done and not self.model.recurrent:  # a hybrid's came before (`step`)
            prefill.sequence.checkpoint(len(prefill.prompt) - 1)
        last = len(self.members) - 1
        if row != last:
            cache.move(last, row)
        self.members[row] = self.members[last]
        self.members.pop()
        if not self.members:
            self.cache = None  # the memory goes back until prompts join again
        elif _bucket(len(self.members)) < cache.rows:
            cache.resize(_bucket(len(self.members)))


def _bucket(rows: int) -> int:
    """Rows of the group's cache: a power of two that holds `rows`."""
    return 1 << max(0, rows - 1).bit_length()
