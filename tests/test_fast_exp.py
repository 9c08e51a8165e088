"""fast_exp: exp, SiLU and softmax in fusable ops equal float64 references to float32
precision, keep the input's dtype, saturate where float32 ends, and their stated gradients are
MLX's; the CPU attention built on them equals MLX's fused kernel, outputs and gradients."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_speculate.models.fast_exp import exp, silu, softmax

X = np.concatenate([np.linspace(-87.0, 87.0, 100_001), [-1e-6, 0.0, 1e-6]]).astype(np.float32)


def relative_error(got: mx.array, want: np.ndarray) -> float:
    return float(np.max(np.abs(np.array(got, dtype=np.float64) - want) / np.abs(want)))


def test_exp_is_float32_exact_and_saturates():
    assert relative_error(exp(mx.array(X)), np.exp(X.astype(np.float64))) < 2e-7
    edges = np.array(exp(mx.array([-1000.0, -88.5, 0.0, 88.5, 1000.0])))
    assert edges[0] == edges[1] == 0 and edges[2] == 1
    assert edges[3] == edges[4] == np.float32(np.exp(np.float32(88.0)))  # the largest it gives
    assert np.isnan(np.array(exp(mx.array([np.nan]))))[0]


def test_silu_matches_float64_and_nn_silu_gradients():
    x64 = X.astype(np.float64)
    want = x64 / (1 + np.exp(-x64))
    keep = np.abs(want) > 1e-30
    got = np.array(silu(mx.array(X)), dtype=np.float64)
    assert np.max(np.abs(got - want)[keep] / np.abs(want[keep])) < 5e-7
    x = mx.random.normal((64, 257), key=mx.random.key(0)) * 8
    w = mx.random.normal((64, 257), key=mx.random.key(1))
    expected = mx.grad(lambda x: mx.sum(w * nn.silu(x)))(x)
    grad = mx.grad(lambda x: mx.sum(w * silu(x)))
    for f in (grad, mx.compile(grad)):
        assert mx.allclose(f(x), expected, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_inputs_keep_their_dtype(dtype):
    x = mx.array(np.linspace(-10, 10, 8192).astype(np.float32)).astype(dtype)  # the fused path
    for ours, theirs in ((exp, mx.exp), (silu, nn.silu)):
        got = ours(x)
        assert got.dtype == dtype
        want = theirs(x.astype(mx.float32))
        assert mx.allclose(got.astype(mx.float32), want, rtol=1e-2, atol=1e-3).item()


def test_inside_a_compiled_graph():
    z = mx.random.normal((3, 1000), key=mx.random.key(2)) * 20

    @mx.compile
    def normalised(z):
        e = exp(z - mx.max(z, axis=-1, keepdims=True))
        return e / mx.sum(e, axis=-1, keepdims=True)

    assert mx.allclose(normalised(z), mx.softmax(z, axis=-1), atol=1e-7).item()


def test_softmax_matches_mlx_in_float32():
    z = mx.random.normal((4, 7, 300), key=mx.random.key(3)) * 15
    assert mx.allclose(softmax(z), mx.softmax(z, axis=-1, precise=True), atol=1e-7).item()
    half = z.astype(mx.float16)
    assert softmax(half).dtype == mx.float16
    w = mx.random.normal(z.shape, key=mx.random.key(4))
    expected = mx.grad(lambda z: mx.sum(w * mx.softmax(z, axis=-1)))(z)
    grad = mx.grad(lambda z: mx.sum(w * softmax(z)))
    for f in (grad, mx.compile(grad)):
        assert mx.allclose(f(z), expected, atol=1e-6).item()


@pytest.mark.parametrize("L", [1, 5])
@pytest.mark.parametrize("mask", [None, "causal", "additive"])
def test_cpu_attention_equals_mlx_fused_attention(L, mask):
    """The CPU path (grouped matmuls, this softmax) against mx.fast's, GQA 6 query heads on 2,
    with enough keys that the CPU takes it."""
    from mlx_speculate.models.attention import MIN_SCORES, scaled_dot_product_attention

    S = 1024
    assert 2 * 6 * L * S >= MIN_SCORES
    keys = [mx.random.key(i) for i in range(4)]
    q = mx.random.normal((2, 6, L, 16), key=keys[0])
    k, v = (mx.random.normal((2, 2, S, 16), key=key) for key in keys[1:3])
    if mask == "additive":
        visible = mx.random.uniform(shape=(2, 1, L, S), key=keys[3]) > 0.3
        mask = mx.where(visible | (mx.arange(S) == S - 1), 0.0, mx.finfo(mx.float32).min)
    if mask == "causal" and L == 1:
        mask = None
    w = mx.random.normal((2, 6, L, 16), key=mx.random.key(5))

    def ours(*a):
        return scaled_dot_product_attention(*a, 0.25, mask)

    def theirs(*a):
        return mx.fast.scaled_dot_product_attention(*a, scale=0.25, mask=mask)

    with mx.stream(mx.cpu):
        got, want = ours(q, k, v), theirs(q, k, v)
        assert got.shape == want.shape == (2, 6, L, 16)
        assert mx.allclose(got, want, atol=1e-5).item()
        for i in range(3):  # heads train through it: its gradients are the fused kernel's
            g = [mx.grad(lambda *a, f=f: mx.sum(w * f(*a)), i)(q, k, v) for f in (ours, theirs)]
            assert mx.allclose(*g, atol=1e-5).item()
