"""The gated delta rule's closed form over chunks (`chunked_delta_rule`, a prompt's forward)
against its token-by-token recurrence (`gated_delta_rule` with every state kept): outputs,
final state and the state marked at each row's token count, across chunk boundaries and on
the nearly parallel keys that make the triangular solve ill-conditioned."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_speculate.models.gated_delta import (
    CHUNK,
    gated_delta_rule,
    l2norm,
    unit_lower_inverse,
)

from .helpers import assert_float32_close

B, H, DK, DV = 2, 3, 16, 8


def _inputs(length: int, seed: int, correlated: bool = False):
    """Keys l2-normalised as the model's are; log-decays below 0, betas in (0, 1)."""
    key = mx.random.key(seed)
    kq, kk, kv, kg, kb, ks = mx.random.split(key, 6)
    q = l2norm(mx.random.normal((B, length, H, DK), key=kq))
    if correlated:  # every key close to one direction: A's entries near beta, all of them
        base = mx.random.normal((B, 1, H, DK), key=kk)
        k = l2norm(base + 0.01 * mx.random.normal((B, length, H, DK), key=ks))
        beta = 0.9 + 0.1 * mx.random.uniform(shape=(B, length, H), key=kb)
        g = -0.001 * mx.random.uniform(shape=(B, length, H), key=kg)
    else:
        k = l2norm(mx.random.normal((B, length, H, DK), key=kk))
        beta = mx.random.uniform(shape=(B, length, H), key=kb)
        g = -0.5 * mx.random.uniform(shape=(B, length, H), key=kg)
    v = mx.random.normal((B, length, H, DV), key=kv)
    state = 0.1 * mx.random.normal((B, H, DK, DV), key=ks)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length", [2, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3])
@pytest.mark.parametrize("correlated", [False, True])
def test_chunks_equal_the_token_loop(length, correlated):
    q, k, v, g, beta, state = _inputs(length, seed=length, correlated=correlated)
    # Row 0 marks the state before its last token, row 1 one inside the first chunk (or at
    # its end, or just past it, as lengths allow).
    at = mx.array([length - 1, min(length, CHUNK + 1) if length > CHUNK else 1], mx.int32)
    loop_out, loop_states, loop_marked = gated_delta_rule(q, k, v, g, beta, state, True, at)
    out, states, marked = gated_delta_rule(q, k, v, g, beta, state, False, at)
    assert len(states) == 1
    for ours, ref in ((out, loop_out), (states[0], loop_states[-1]), (marked, loop_marked)):
        assert mx.all(mx.isfinite(ours)).item()
        assert_float32_close(ours, ref, rtol=1e-4, scaled=1e-4)
    # The marked states are the loop's states after at[b] tokens, row by row.
    for b, count in enumerate(at.tolist()):
        assert_float32_close(marked[b], loop_states[count][b], rtol=1e-4, scaled=1e-4)


@pytest.mark.parametrize("n", [1, 5, 64, 100])
def test_unit_lower_inverse_inverts(n):
    a = mx.tril(0.1 * mx.random.normal((2, n, n), key=mx.random.key(n)), k=-1)
    inverse = unit_lower_inverse(a)
    eye = mx.eye(n)
    assert_float32_close((eye + a) @ inverse, mx.broadcast_to(eye, (2, n, n)), scaled=1e-4)
