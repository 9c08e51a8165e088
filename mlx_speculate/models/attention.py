"""Scaled dot-product attention: MLX's fused kernel where the device has one (Metal, CUDA); on
the CPU, where MLX computes it op by op with its scalar exp, the same ops with `fast_exp`'s
softmax, once there are enough scores for the exp to matter. Both group the query heads that
share a key-value head into one matmul.

Why: MLX's CPU softmax runs exp one element at a time through libm, which dominates attention
over wide batches and long prompts; the fused polynomial exp takes most of that away.
"""

from __future__ import annotations

import mlx.core as mx

from .context import additive_mask
from .fast_exp import softmax

# Below this many scores there is little exp to save, and MLX's own path runs fewer ops: a
# tiny model decoding one sequence (stories260K: 8 heads x 1 query x ~100 keys a layer) is
# bound by op count.
MIN_SCORES = 8192


def scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
) -> mx.array:
    """(B, H, L, D) queries over (B, Hk, S, D) keys and values; `mask` additive, broadcasting
    to (B, H, L, S), or "causal" (the L queries are the last L of the S positions). `sinks`
    (H,): a learned logit per head that joins every row's softmax without a value (gpt-oss),
    so a row may attend to nothing; masked slots stay out of it as they do of the rest.
    `softcap`: scaled scores become softcap * tanh(scores / softcap) before the mask (Gemma 2),
    which MLX's fused kernel does not do, so these take the op by op path everywhere."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    fused = mx.default_device() != mx.cpu or B * H * L * S < MIN_SCORES
    if fused and softcap is None:
        return mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask, sinks=sinks
        )
    grouped = (q * mx.array(scale, q.dtype)).reshape(B, Hk, H // Hk * L, D)
    scores = (grouped @ k.swapaxes(-1, -2)).reshape(B, H, L, S)
    if softcap is not None:
        cap = mx.array(softcap, scores.dtype)
        scores = mx.tanh(scores / cap) * cap
    if isinstance(mask, str):
        mask = additive_mask(mx.arange(S)[None] <= mx.arange(S - L, S)[:, None], scores.dtype)
    if mask is not None:
        scores = scores + mask
    if sinks is None:
        probs = softmax(scores)
    else:  # the sink's column joins the softmax, then leaves: it has no value
        sink = mx.broadcast_to(sinks.astype(scores.dtype)[:, None, None], (B, H, L, 1))
        probs = softmax(mx.concatenate([scores, sink], axis=-1))[..., :S]
    return (probs.reshape(B, Hk, H // Hk * L, S) @ v).reshape(B, H, L, D)
