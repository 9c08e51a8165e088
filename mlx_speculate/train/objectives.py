"""Stage 3's losses, one per head kind, as the official trainers define them, and fresh heads.

A batch holds B conversations padded to T: `tokens` (B, T), `answer` (B, T) 1 on the target's
own tokens (0 on padding), `features` (B, T, F), `top_ids`/`top_logits` (B, T, k): the target's
likeliest next tokens after each position (EAGLE-3's target). Every loss counts only positions
whose predicted token is an answer token, and returns (loss, (top-1 hits, positions counted));
the accuracy is the first draft token's, against the target's own top-1.

- EAGLE-1 (SafeAILab `eagle/train/main.py`): position t reads embed(x_{t+1}) and f_t plus
  uniform noise and regresses f_{t+1} (SmoothL1), plus 0.1 x cross-entropy of the target's
  lm_head over its output against the target's full distribution of x_{t+2} (its lm_head
  over f_{t+1}).
- EAGLE-3 (`eagle/traineagle3`, SpecForge): training-time test, 7 steps unrolled; step i feeds
  step i-1's outputs back, attends to the real prefix and its own earlier steps at the same
  position, predicts x_{t+2+i} with weight 0.8^i, against the target's distribution restricted
  to the draft vocabulary (positions whose target top-1 lies outside it do not count).
- Medusa: head j predicts x_{t+2+j} from f_t by cross-entropy against the target's tokens.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..heads.eagle import Eagle1Head, Eagle3Head
from ..heads.medusa import MedusaHeads
from ..models.context import additive_mask

Batch = tuple[mx.array, mx.array, mx.array, mx.array, mx.array]


def _shift(x: mx.array, by: int) -> mx.array:
    """x[:, t + by] at t, zeros past the end: (B, T, ...) -> (B, T, ...)."""
    if by == 0:
        return x
    pad = mx.zeros((x.shape[0], by, *x.shape[2:]), dtype=x.dtype)
    return mx.concatenate([x[:, by:], pad], axis=1)


def _soft_ce(logits: mx.array, ids: mx.array, top_logits: mx.array, keep: mx.array) -> mx.array:
    """Per position -sum_j p_j log q(ids_j): p the target's softmax over its kept logits
    (`keep` False drops an entry), q the head's distribution. (B, T)."""
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.softmax(mx.where(keep, top_logits, -1e9), axis=-1)
    return -mx.sum(p * mx.take_along_axis(logq, ids, axis=-1), axis=-1)


def _masked_mean(x: mx.array, mask: mx.array) -> mx.array:
    return mx.sum(x * mask) / mx.maximum(mx.sum(mask), 1)


def eagle1_loss(
    head: Eagle1Head, batch: Batch, embed: mx.array, lm_head: mx.array, key: mx.array,
    noise: float = 0.2, p_weight: float = 0.1,
) -> tuple[mx.array, tuple[mx.array, mx.array]]:  # fmt: skip
    tokens, answer, feats, top_ids, top_logits = batch
    T = tokens.shape[1]
    # The official AddUniformNoise: (U(0,1) - 0.5) * std * 512 / length.
    f = feats + (mx.random.uniform(shape=feats.shape, key=key) - 0.5) * noise * 512 / T
    out = head(embed[_shift(tokens, 1)], f, head.make_cache(), from_target=True)  # (B, T, h)
    logits = out @ lm_head.T  # (B, T, V)
    mask = _shift(answer, 2).astype(mx.float32)
    v = nn.losses.smooth_l1_loss(out, _shift(feats, 1), reduction="none").mean(-1)
    # As the official trainer: the target's full distribution, from its stored final state
    # through the frozen lm_head, not the cache's top-k.
    target = mx.stop_gradient(mx.softmax(_shift(feats, 1) @ lm_head.T, axis=-1))
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = -mx.sum(target * logq, axis=-1)
    hits = (mx.argmax(logits, axis=-1) == _shift(top_ids, 1)[..., 0]) * mask
    return _masked_mean(v + p_weight * p, mask), (mx.sum(hits), mx.sum(mask))


def ttt_mask(T: int, step: int) -> mx.array | None:
    """Step `step`'s (T, (step + 1) T) mask: causal over the real prefix (step 0's keys), and
    each earlier step's key at the query's own position."""
    if step == 0:
        return None
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    eye = mx.eye(T, dtype=mx.bool_)
    return additive_mask(mx.concatenate([causal] + [eye] * step, axis=1), mx.float32)


def eagle3_loss(
    head: Eagle3Head, batch: Batch, embed: mx.array, t2d: mx.array, key: mx.array,
    steps: int = 7, decay: float = 0.8,
) -> tuple[mx.array, tuple[mx.array, mx.array]]:  # fmt: skip
    """`t2d`: (V,) int32 each target id's draft id, -1 outside the draft vocabulary."""
    tokens, answer, feats, top_ids, top_logits = batch
    T = tokens.shape[1]
    cache = head.make_cache()
    hidden, total = feats, mx.array(0.0)
    hits = count = mx.array(0.0)
    for i in range(steps):
        positions = mx.arange(T, dtype=mx.int32) + i
        out = head(
            embed[_shift(tokens, 1 + i)], hidden, cache, from_target=i == 0,
            positions=positions, mask=ttt_mask(T, i),
        )  # fmt: skip
        logits = head.draft_logits(out)  # (B, T, Vd)
        ids = t2d[_shift(top_ids, 1 + i)]  # (B, T, k) draft ids, -1 outside
        mask = _shift(answer, 2 + i).astype(mx.float32) * (ids[..., 0] >= 0)
        ce = _soft_ce(logits, mx.maximum(ids, 0), _shift(top_logits, 1 + i), ids >= 0)
        total = total + decay**i * _masked_mean(ce, mask)
        if i == 0:
            hits = mx.sum((mx.argmax(logits, axis=-1) == ids[..., 0]) * mask)
            count = mx.sum(mask)
        hidden = head.feedback(out)
    return total, (hits, count)


def medusa_loss(
    heads: MedusaHeads, batch: Batch, *_: mx.array
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    tokens, answer, feats, _, _ = batch
    logits = heads(feats)  # (K, B, T, V)
    total = mx.array(0.0)
    hits = count = mx.array(0.0)
    for j in range(heads.num_heads):
        labels, mask = _shift(tokens, 2 + j), _shift(answer, 2 + j).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits[j], labels, reduction="none")
        total = total + _masked_mean(ce, mask)
        if j == 0:
            hits = mx.sum((mx.argmax(logits[0], axis=-1) == labels) * mask)
            count = mx.sum(mask)
    return total, (hits, count)
