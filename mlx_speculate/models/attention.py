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
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """(B, H, L, D) queries over (B, Hk, S, D) keys and values; `mask` additive, broadcasting
    to (B, H, L, S), or "causal" (the L queries are the last L of the S positions)."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if mx.default_device() != mx.cpu or B * H * L * S < MIN_SCORES:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    grouped = (q * mx.array(scale, q.dtype)).reshape(B, Hk, H // Hk * L, D)
    scores = (grouped @ k.swapaxes(-1, -2)).reshape(B, H, L, S)
    if isinstance(mask, str):
        mask = additive_mask(mx.arange(S)[None] <= mx.arange(S - L, S)[:, None], scores.dtype)
    if mask is not None:
        scores = scores + mask
    return (softmax(scores).reshape(B, Hk, H // Hk * L, S) @ v).reshape(B, H, L, D)
