"""The batch's verify forward, compiled: one graph per (rows, width, attended span, cache
capacity, chain or tree, taps), as the single-stream step is (step.py).

Inputs are the (B, N) tokens and rotary positions, each row's start slot (B,), a tree step's
(B, N, N) visibility among the new tokens, and the cache's arrays; outputs are the logits,
hidden states and taps of every row and the cache's arrays with the new keys written at each
row's own slots. Nothing in the graph depends on the host offsets: rows grow by buckets
(engine.BUCKETS), widths are the planner's few, the span takes two sizes an octave
(`KVCache.span`) and the capacity grows a chunk at a time, so the traces stay few.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..graphs import compiled
from ..models.base import CausalLM, ModelOutput
from .cache import BatchKVCache


def forward(
    model: CausalLM,
    cache: BatchKVCache,
    tokens: mx.array,
    positions: mx.array,
    mask: mx.array | None,
    taps: tuple[int, ...],
) -> ModelOutput:
    """The target over (B, N) `tokens` at `positions`, row b's keys written from its start
    slot (`BatchKVCache.prepare` reserved the room and set the starts and span); `mask`: None
    (causal) or (B, N, N) bool. Lazy; the cache takes the written arrays."""
    B, N = tokens.shape
    span = cache.attended
    key = ("batch", B, N, mask is None, taps)
    build = lambda: _forward_fn(model, cache, mask is None, taps, span)  # noqa: E731
    fn = compiled(model, key, build, span=span)
    args = (tokens, positions, cache.start) + (() if mask is None else (mask,))
    logits, hidden, *taps_out = cache.take_outputs(fn(*args, *cache.state))
    return ModelOutput(logits, hidden, tuple(taps_out))


def _forward_fn(
    model: CausalLM, cache: BatchKVCache, chain: bool, taps: tuple[int, ...], span: int
) -> Callable:
    def step(tokens, positions, start, *rest):
        mask, arrays = (None, rest) if chain else (rest[0], rest[1:])
        view = cache.fresh()
        view.adopt(arrays)
        view.start, view.attended = start, span
        out = model(tokens, view, positions=positions, mask=mask, taps=taps)
        return out.logits, out.hidden, *out.taps, *view.state

    return step
