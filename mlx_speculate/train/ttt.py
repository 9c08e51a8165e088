"""EAGLE-3's training-time test: the head's steps unrolled over a whole conversation, with the
official trainer's diagonal attention.

Step 0 reads the target's taps and attends causally over the conversation. Step i feeds step
i-1's outputs back at every position and, at position t, attends to step 0's keys at 0..t
(the real prefix) and to the keys of steps 1..i at t alone (its own earlier drafts there), as
a draft i levels deep sees its ancestors at inference. Those i extra keys are dot products
per position, so step i costs one T x T attention plus O(i T), where attending over all
(i + 1) T cached keys under a mask costs (i + 1) T x T.

Rotary positions: step i's queries and keys sit at t + i. Shapes are fixed by (B, T) and the
step count; nothing syncs with the host.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from ..heads.eagle import Eagle3Head
from ..models.rope import RotaryEmbedding, native


def unroll(head: Eagle3Head, embeds: list[mx.array], taps: mx.array) -> Iterator[mx.array]:
    """Step i's (B, T, h) outputs for i < len(embeds), where `embeds[i]` (B, T, h) is the
    embedding each position's step i reads and `taps` (B, T, F) the target's states."""
    layer, rope = head.midlayer, head.rope
    attn = layer.self_attn
    B, T, _ = taps.shape
    H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    keys, values = [], []  # per step: (B, KV, T, D)
    hidden = head.fuse(taps)
    for i, embed in enumerate(embeds):
        x, residual = layer.mix(embed, hidden)  # (B, T, 2h), (B, T, h)
        q = _rotate(rope, attn.q_proj(x).reshape(B, T, H, D).transpose(0, 2, 1, 3), i)
        keys.append(_rotate(rope, attn.k_proj(x).reshape(B, T, KV, D).transpose(0, 2, 1, 3), i))
        values.append(attn.v_proj(x).reshape(B, T, KV, D).transpose(0, 2, 1, 3))
        q = q.reshape(B, KV, H // KV, T, D) * attn.scale  # (B, KV, G, T, D): G queries a key
        prefix = q @ keys[0][:, :, None].swapaxes(-1, -2)  # (B, KV, G, T, T)
        prefix = mx.where(causal, prefix, mx.finfo(prefix.dtype).min)
        diagonal = [mx.sum(q * k[:, :, None], axis=-1, keepdims=True) for k in keys[1:]]
        p = mx.softmax(mx.concatenate([prefix, *diagonal], axis=-1), axis=-1, precise=True)
        out = p[..., :T] @ values[0][:, :, None]  # (B, KV, G, T, D)
        for j, v in enumerate(values[1:]):
            out = out + p[..., T + j, None] * v[:, :, None]
        out = out.reshape(B, H, T, D).transpose(0, 2, 1, 3).reshape(B, T, H * D)
        out = layer.finish(residual + attn.o_proj(out))
        yield out
        hidden = head.feedback(out)


def _rotate(rope: RotaryEmbedding, x: mx.array, step: int) -> mx.array:
    """(B, H, T, D) rotated at positions step..T - 1 + step, as the head's forward would."""
    T = x.shape[2]
    positions = mx.arange(T, dtype=mx.int32) + step
    freqs = rope.freqs(T + step)  # the largest position + 1
    if native():
        return rope(x, 0, positions, freqs)
    return rope.rotate(x, rope.tables(0, positions, T, freqs, x.dtype))
