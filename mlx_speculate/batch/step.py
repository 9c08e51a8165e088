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

from ..graphs import compiled, synchronous
from ..models.base import CausalLM, ModelOutput
from ..policy.batch import MAX_WIDTH
from ..step import bucket
from .cache import BatchKVCache

# The tree widths built ahead (`build`): the buckets of every tree the planner may verify.
TREE_WIDTHS = tuple(sorted({bucket(n) for n in range(2, MAX_WIDTH + 1)}))


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


def build(model: CausalLM, rows: int) -> None:
    """Builds the batch step's graphs for `rows` sequences now, in this thread: a plain step's
    and, where the target's cache follows trees, a tree step's of each of TREE_WIDTHS, over
    an empty cache (their kernels serve every span). What a server runs at start-up, before
    its first requests: on the CPU each graph would otherwise run eagerly until the machine
    is idle long enough to build it (graphs.py), and concurrent requests leave it no idle.
    Its inputs are laid out as the engine's (stacked, contiguous): a compiled kernel is built
    per layout, and a broadcast one would build kernels no step uses."""
    cache = BatchKVCache.of(model, rows)
    shapes = [(1, True)] + [(n, False) for n in TREE_WIDTHS if cache.follows_trees]
    with synchronous():
        for n, chain in shapes:
            cache.prepare(n)
            tokens = mx.zeros((rows, n), dtype=mx.int32)
            positions = mx.stack([mx.arange(n, dtype=mx.int32)] * rows)
            mask = None if chain else mx.stack([mx.eye(n, dtype=mx.bool_)] * rows)
            out = forward(model, cache, tokens, positions, mask, ())
            mx.eval(out.logits, cache.state)
