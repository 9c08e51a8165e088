"""Compiled graphs per model: each built once, shared by every decoder of the model (a
server's sessions, repeated generate calls), and every trace counted, since a step that paid
for one tells nothing of what its size costs (`decode.Step.traced`)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from .memo import Table, per_model

# Compiled functions per model (keyed by id, dropped with the model).
_COMPILED: Table = {}
_built = 0  # graphs traced so far


def built() -> int:
    """How many graphs the functions `compiled` makes have traced: one on each call with
    input shapes not seen before (a first call, and mx.compile traces again when a cache's
    storage grows: a step that traced costs several times a steady one)."""
    return _built


def compiled(model, key: tuple, build: Callable[[], Callable], traced: bool = True) -> Callable:
    """The function `build()` makes for `model` and `key`, under `mx.compile` (the random state
    passed through) unless `traced` is False (a model that
    cannot be traced); built once. Weights are the graph's constants, but a model with scalar
    weights passes its arrays as inputs (`_scalar_weights`)."""

    def make() -> Callable:
        fn = build()
        if traced:
            # Weights are evaluated first: a lazy one (random, quantized or cast in memory,
            # loaded lazily) would be computed again inside every call.
            mx.eval(model.parameters())
            state = mx.random.state
            inputs = [state, model] if _scalar_weights(model) else state
            fn = _counted(mx.compile(fn, inputs=inputs, outputs=state))
        return fn

    return per_model(_COMPILED, model, key, make)


def _scalar_weights(model) -> bool:
    """Whether `model` has a weight of one element (Gemma 4's per-layer `layer_scalar`). A graph
    inlines its scalar constants into its kernels, so such weights held as constants make a
    kernel per layer, each compiled by the backend's JIT on a model's first request; as inputs
    they share one (the module read on each call, which costs a traversal of its arrays)."""
    return any(w.size == 1 for _, w in tree_flatten(model.parameters()))


def _counted(fn: Callable) -> Callable:
    """`fn`, counting in `built()` the calls with input shapes it has not seen."""
    seen: set[tuple] = set()

    def call(*args: mx.array):
        global _built
        shapes = tuple(a.shape for a in args)
        if shapes not in seen:
            seen.add(shapes)
            _built += 1
        return fn(*args)

    return call
