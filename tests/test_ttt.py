"""EAGLE-3's training-time test with diagonal attention equals the head's own forward with its
KV cache holding every earlier step and a mask that lets step i see the causal prefix of step 0
and each earlier step's key at the query's position only."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.heads.eagle import Eagle3Head, EagleConfig
from mlx_speculate.models.context import additive_mask
from mlx_speculate.train.ttt import unroll

LAYER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rms_norm_eps=1e-5, vocab_size=97, max_position_embeddings=256,
             num_hidden_layers=1, rope_theta=10000.0)  # fmt: skip


def reference(head: Eagle3Head, embeds: list[mx.array], taps: mx.array) -> list[mx.array]:
    """Every step through the head's forward: the cache grows by T keys a step."""
    T = taps.shape[1]
    cache, hidden, outs = head.make_cache(), taps, []
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    for i, embed in enumerate(embeds):
        allowed = mx.concatenate([causal] + [mx.eye(T, dtype=mx.bool_)] * i, axis=1)
        out = head(embed, hidden, cache, from_target=i == 0,
                   positions=mx.arange(T, dtype=mx.int32) + i,
                   mask=None if i == 0 else additive_mask(allowed, mx.float32))  # fmt: skip
        outs.append(out)
        hidden = head.feedback(out)
    return outs


@pytest.mark.parametrize("flags", [(), ("norm_before_residual", "norm_output")])
def test_diagonal_attention_equals_the_masked_full_attention(flags):
    mx.random.seed(0)
    head = Eagle3Head(EagleConfig(version=3, layer=LAYER, taps=(0, 1, 2), flags=flags))
    B, T, steps = 2, 12, 4
    taps = mx.random.normal((B, T, 3 * 64))
    embeds = [mx.random.normal((B, T, 64)) for _ in range(steps)]
    ours, theirs = list(unroll(head, embeds, taps)), reference(head, embeds, taps)
    assert len(ours) == steps
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-4).item(), (i, mx.abs(a - b).max().item())

    def grads(steps_of):  # of a loss over every step, as the training step follows them
        def loss(h):
            return sum((o**2).mean() * 0.8**i for i, o in enumerate(steps_of(h, embeds, taps)))

        return dict(tree_flatten(nn.value_and_grad(head, loss)(head)[1]))

    ga, gb = grads(lambda *a: list(unroll(*a))), grads(reference)
    for k in ga:
        assert mx.allclose(ga[k], gb[k], atol=1e-5, rtol=1e-3).item(), k
