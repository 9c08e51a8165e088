"""exp, SiLU and softmax in the elementwise ops that `mx.compile` fuses into one kernel.

MLX's x86 CPU build evaluates `exp` (so `sigmoid`, `silu` and `softmax`) one element at a time
through libm calls, several times slower than a vectorised exp. This is the same kind of
algorithm (Cephes' expf: e^x = 2^k e^r, 2^k by shifting k into a float's exponent, a polynomial
for e^r), written as ops a compiled graph fuses into one kernel, which pays off on wide inputs
(a vocabulary-wide training loss, a prompt's MLP activations). It computes in float32 and
returns the input's dtype; on Metal both versions are bound by memory traffic.

Compiled for each input shape (the exponent's bit cast has no shapeless form): a new shape
costs one trace; inside a compiled graph they are traced inline. Called eagerly (a prompt's
forward), SiLU and softmax run MLX's own ops until their kernels are built (`graphs.Fused`).
The bit cast has no gradient either, so SiLU and softmax state theirs."""

from __future__ import annotations

import mlx.core as mx

from ..graphs import Fused
from .activations import silu as mlx_silu

# e^r on [-ln2 / 2, ln2 / 2] (Cephes expf), highest power first; ln 2 = _LN2_HI + _LN2_LO.
_POLY = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_ROUND = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds a float32 to an integer


@mx.compile
def exp(x: mx.array) -> mx.array:
    """e^x elementwise (relative error 1.2e-7); saturates at e^88, 0 below e^-88. It has no
    gradient (MLX's bit cast has none): a function differentiated through it states its own
    vjp, as the training losses' logsumexp and `silu` do."""
    # Past +-88 the exponent no longer fits a float32.
    x32 = mx.clip(x.astype(mx.float32), -88.0, 88.0)
    k = (x32 * 1.4426950408889634 + _ROUND) - _ROUND  # nearest integer to x / ln 2, no libm
    r = x32 - k * _LN2_HI - k * _LN2_LO  # exact in two steps (Cody-Waite)
    p = mx.array(_POLY[0], mx.float32)
    for c in _POLY[1:]:
        p = p * r + c
    p = p * r * r + r + 1.0
    two_k = mx.view((k.astype(mx.int32) + 127) << 23, mx.float32)
    return (p * two_k).astype(x.dtype)


def _fused_silu(x: mx.array) -> mx.array:
    y = x.astype(mx.float32)
    return (y / (1.0 + exp(-y))).astype(x.dtype)


_silu = Fused(_fused_silu, lambda x: x * mx.sigmoid(x))  # eager: nn.silu's ops, unfused


@mx.compile
def _silu_grad(x: mx.array, cotangent: mx.array) -> mx.array:
    y = x.astype(mx.float32)
    s = 1.0 / (1.0 + exp(-y))
    return (cotangent * s * (1.0 + y * (1.0 - s))).astype(x.dtype)


@mx.custom_function
def _silu_with_grad(x: mx.array) -> mx.array:
    return _silu(x)


@_silu_with_grad.vjp
def _silu_vjp(x, cotangent, output):  # one input, one output: arrays, not tuples
    return (_silu_grad(x, cotangent),)


# Below this many elements the call's overhead outweighs the exp it saves: a tiny model's MLP
# (stories260K: 172 elements a token) keeps MLX's.
MIN_ELEMENTS = 4096


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), as `nn.silu` (`activations.silu`, which it calls below MIN_ELEMENTS)."""
    return mlx_silu(x) if x.size < MIN_ELEMENTS else _silu_with_grad(x)


def _fused_softmax(x: mx.array) -> mx.array:
    y = x.astype(mx.float32)
    e = exp(y - mx.max(y, axis=-1, keepdims=True))
    return (e / mx.sum(e, axis=-1, keepdims=True)).astype(x.dtype)


_softmax = Fused(_fused_softmax, lambda x: mx.softmax(x, axis=-1, precise=True))


@mx.compile
def _softmax_grad(p: mx.array, cotangent: mx.array) -> mx.array:
    q, c = p.astype(mx.float32), cotangent.astype(mx.float32)
    return (q * (c - mx.sum(c * q, axis=-1, keepdims=True))).astype(p.dtype)


@mx.custom_function
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis, computed in float32 (as MLX's precise softmax)."""
    return _softmax(x)


@softmax.vjp
def _softmax_vjp(x, cotangent, output):
    return (_softmax_grad(output, cotangent),)
