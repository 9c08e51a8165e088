"""The activations the models call (as `mlx.nn`'s: the same ops, fused into one kernel), whose
eager calls run unfused until their kernels are built.

Outside `graphs.eager()` they are `mlx.nn`'s compiled functions, traced inline into a step's
graph. Within it (a prompt's forward, a graph's eager call while its kernels build) they are
`graphs.Fused`: MLX's own ops until the background thread has built the fused kernel. Why: a
compiled function's first call waits for the compiler (seconds on the CPU), which a model's
first request should not."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..graphs import Fused, is_eager


def _gelu_approx(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _softplus(x: mx.array) -> mx.array:
    return mx.logaddexp(x, 0)


def _silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


# Their eager forms: the same ops compiled once built, unfused until then.
_EAGER_GELU_APPROX = Fused(_gelu_approx, _gelu_approx)
_EAGER_SOFTPLUS = Fused(_softplus, _softplus)
_EAGER_SILU = Fused(_silu, _silu)


def gelu_approx(x: mx.array) -> mx.array:
    """`nn.gelu_approx`: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    return _EAGER_GELU_APPROX(x) if is_eager() else nn.gelu_approx(x)


def softplus(x: mx.array) -> mx.array:
    """`nn.softplus`: log(1 + e^x)."""
    return _EAGER_SOFTPLUS(x) if is_eager() else nn.softplus(x)


def silu(x: mx.array) -> mx.array:
    """`nn.silu`: x sigmoid(x) (fast_exp's `silu` for wide inputs on the CPU)."""
    return _EAGER_SILU(x) if is_eager() else nn.silu(x)
