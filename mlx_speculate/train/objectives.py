"""Stage 3's losses, one per head kind, as the official trainers define them, and fresh heads.

A batch holds B conversations padded to T: `tokens` (B, T), `answer` (B, T) 1 on the target's
own tokens (0 on padding), `features` (B, T, F), `top_ids`/`top_logits` (B, T, k): the target's
likeliest next tokens after each position, and `counted` (N,) the flat indices of the answer
tokens (-1: none). Every loss counts the predictions of answer tokens only, and projects onto
the vocabulary only at those positions (the projection and its softmax are most of a step);
it returns (loss, (top-1 hits, positions counted)), the accuracy being the first draft
token's, against the target's own top-1. The target's distribution is its top k logits
renormalised (stored by the features stage), so no step re-runs its 49k-wide lm_head.

- EAGLE-1 (SafeAILab `eagle/train/main.py`): position t reads embed(x_{t+1}) and f_t plus
  uniform noise and regresses f_{t+1} (SmoothL1), plus 0.1 x cross-entropy of the target's
  lm_head over its output against the target's distribution of x_{t+2}.
- EAGLE-3 (`eagle/traineagle3`, SpecForge): training-time test, 7 steps unrolled; step i feeds
  step i-1's outputs back, attends to the real prefix and its own earlier steps at the same
  position, predicts x_{t+2+i} with weight 0.8^i, against the target's distribution restricted
  to the draft vocabulary (positions whose target top-1 lies outside it do not count).
- Medusa: head j predicts x_{t+2+j} from f_t by cross-entropy against the target's tokens.
- DFlash (z-lab publishes no trainer; the DFlash paper's objective as SpecForge's
  `specforge/core/dflash.py` implements it): blocks anchored at random answer tokens, each row
  of a block predicting the target's own token at its position, weighted down exponentially
  along the block (`dflash_loss`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..heads.dflash import DFlashHead
from ..heads.eagle import Eagle1Head, Eagle3Head
from ..heads.medusa import MedusaHeads
from ..models.fast_exp import exp
from .ttt import unroll

Batch = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]


def _shift(x: mx.array, by: int) -> mx.array:
    """x[:, t + by] at t, zeros past the end: (B, T, ...) -> (B, T, ...)."""
    if by == 0:
        return x
    pad = mx.zeros((x.shape[0], by, *x.shape[2:]), dtype=x.dtype)
    return mx.concatenate([x[:, by:], pad], axis=1)


def _at(x: mx.array, counted: mx.array, back: int) -> mx.array:
    """x's rows `back` positions before each counted token: (B, T, ...) -> (N, ...)."""
    B, T = x.shape[:2]
    return x.reshape(B * T, *x.shape[2:])[mx.maximum(counted - back, 0)]


def _weights(counted: mx.array, T: int, back: int) -> mx.array:
    """(N,) 1 where a counted token has a position `back` before it in its own row."""
    return ((counted >= 0) & (counted % T >= back)).astype(mx.float32)


@mx.custom_function
def _logsumexp_keeping_softmax(z: mx.array) -> tuple[mx.array, mx.array]:
    """(logsumexp, softmax) over the last axis, in one exp pass. The backward pass reuses the
    softmax where MLX's own logsumexp computes exp again: on a CPU the vocabulary-wide exp is
    most of a training step. The exp is fast_exp's (fused, where MLX's CPU exp is scalar)."""
    m = mx.max(z, axis=-1, keepdims=True)
    e = exp(z - m)
    s = mx.sum(e, axis=-1, keepdims=True)
    return (m + mx.log(s))[..., 0], e / s


@_logsumexp_keeping_softmax.vjp
def _logsumexp_vjp(primals, cotangents, outputs):
    return (cotangents[0][..., None] * outputs[1],)  # the softmax output is never differentiated


def _logsumexp(z: mx.array) -> mx.array:
    return _logsumexp_keeping_softmax(z)[0]


def _soft_ce(logits: mx.array, ids: mx.array, top_logits: mx.array, keep: mx.array) -> mx.array:
    """Per row -sum_j p_j log q(ids_j): p the target's softmax over its kept logits (`keep`
    False drops an entry), q the head's distribution. (N, V) logits -> (N,)."""
    p = mx.softmax(mx.where(keep, top_logits, -1e9), axis=-1)
    picked = mx.take_along_axis(logits, ids, axis=-1)  # (N, k)
    return _logsumexp(logits) - mx.sum(p * picked, axis=-1)


def _mean(x: mx.array, weights: mx.array) -> mx.array:
    return mx.sum(x * weights) / mx.maximum(mx.sum(weights), 1)


def eagle1_loss(
    head: Eagle1Head,
    batch: Batch,
    embed: mx.array,
    lm_head: mx.array,
    key: mx.array | None,
    noise: float = 0.2,
    p_weight: float = 0.1,
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    """`key` None: no input noise (held-out evaluation, as the official test loader)."""
    tokens, _, feats, top_ids, top_logits, counted = batch
    T = tokens.shape[1]
    f = feats
    if key is not None:  # the official AddUniformNoise: (U(0,1) - 0.5) * std * 512 / length
        f = feats + (mx.random.uniform(shape=feats.shape, key=key) - 0.5) * noise * 512 / T
    out = head(embed[_shift(tokens, 1)], f, head.make_cache(), from_target=True)  # (B, T, h)
    # Position t = s - 2 predicts answer token s from the target's state and logits at s - 1.
    w, out = _weights(counted, T, 2), _at(out, counted, 2)  # (N,), (N, h)
    ids = _at(top_ids, counted, 1)  # (N, k)
    v = nn.losses.smooth_l1_loss(out, _at(feats, counted, 1), reduction="none").mean(-1)
    logits = out @ lm_head.T  # (N, V)
    p = _soft_ce(logits, ids, _at(top_logits, counted, 1), mx.array(True))
    hits = (mx.argmax(logits, axis=-1) == ids[:, 0]) * w
    return _mean(v + p_weight * p, w), (mx.sum(hits), mx.sum(w))


def eagle3_loss(
    head: Eagle3Head,
    batch: Batch,
    embed: mx.array,
    t2d: mx.array,
    key: mx.array | None,
    steps: int = 7,
    decay: float = 0.8,
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    """`t2d`: (V,) int32 each target id's draft id, -1 outside the draft vocabulary."""
    tokens, _, feats, top_ids, top_logits, counted = batch
    T = tokens.shape[1]
    total = hits = count = mx.array(0.0)
    ids = t2d[_at(top_ids, counted, 1)]  # (N, k) draft ids, -1 outside
    keep, target = ids[:, 0] >= 0, _at(top_logits, counted, 1)
    embeds = [embed[_shift(tokens, 1 + i)] for i in range(steps)]
    for i, out in enumerate(unroll(head, embeds, feats)):
        # Step i's position s - 2 - i predicts answer token s (the target's logits at s - 1).
        logits = head.draft_logits(_at(out, counted, 2 + i))  # (N, Vd)
        w = _weights(counted, T, 2 + i) * keep
        ce = _soft_ce(logits, mx.maximum(ids, 0), target, ids >= 0)
        total = total + decay**i * _mean(ce, w)
        if i == 0:
            hits, count = mx.sum((mx.argmax(logits, axis=-1) == ids[:, 0]) * w), mx.sum(w)
    return total, (hits, count)


def medusa_loss(
    heads: MedusaHeads, batch: Batch, *_: mx.array
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    tokens, _, feats, _, _, counted = batch
    T = tokens.shape[1]
    labels = _at(tokens, counted, 0)  # (N,)
    total = mx.array(0.0)
    hits = count = mx.array(0.0)
    for j in range(heads.num_heads):
        # Head j at position s - 2 - j predicts answer token s.
        logits = heads.head(j, _at(feats, counted, 2 + j))  # (N, V)
        w = _weights(counted, T, 2 + j)
        ce = _logsumexp(logits) - mx.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        total = total + _mean(ce, w)
        if j == 0:
            hits, count = mx.sum((mx.argmax(logits, axis=-1) == labels) * w), mx.sum(w)
    return total, (hits, count)


# The DFlash paper's decay of the loss along a block, by block size (Eq. 4; SpecForge's
# suggested --loss-decay-gamma); other sizes: half the block.
DFLASH_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def dflash_anchors(
    answer: mx.array, count: int, key: mx.array | None
) -> tuple[mx.array, mx.array]:
    """(B, count) int32 block anchors a row, drawn without replacement from its answer tokens
    followed by another (`key` None: a fixed draw), and (B, count) whether each is one (False
    where a row has fewer)."""
    B, T = answer.shape
    ok = (answer[:, :-1] > 0) & (answer[:, 1:] > 0)  # (B, T - 1)
    ok = mx.concatenate([ok, mx.zeros((B, 1), dtype=mx.bool_)], axis=1)
    draw = mx.random.uniform(shape=(B, T), key=mx.random.key(0) if key is None else key)
    anchors = mx.argsort(mx.where(ok, draw, 2.0), axis=1)[:, :count].astype(mx.int32)
    return anchors, mx.take_along_axis(ok, anchors, axis=1)


def dflash_loss(
    head: DFlashHead,
    batch: Batch,
    embed: mx.array,
    lm_head: mx.array,
    key: mx.array | None,
    anchors: int = 512,
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    """DFlash, as SpecForge's `OnlineDFlashModel` trains it: up to `anchors` blocks a
    conversation (at most T // 2 of its T padded tokens), anchored without replacement at
    answer tokens followed by one (`key` None: a fixed draw, for held-out accuracy), all in
    one forward: block j holds the anchor's token then mask tokens at the anchor's next
    positions, sees the context rows before its anchor and its own rows, and its row i
    predicts the conversation's token i places after the anchor (the target's own
    continuation) by cross-entropy weighted exp(-(i - 1) / gamma) (`DFLASH_GAMMA`), answer
    tokens only. Accuracy: the first draft's top-1."""
    tokens, answer, feats, _, _, _ = batch
    B, T = tokens.shape
    S, A = head.config.block_size, max(1, min(anchors, T // 2))
    gamma = DFLASH_GAMMA.get(S, S / 2)
    starts, keep = dflash_anchors(answer, A, key)  # (B, A) each
    offsets = mx.arange(S, dtype=mx.int32)
    positions = starts[..., None] + offsets  # (B, A, S)
    flat = mx.minimum(positions, T - 1).reshape(B, A * S)
    labels = mx.take_along_axis(tokens, flat, axis=1).reshape(B, A, S)
    valid = (mx.take_along_axis(answer, flat, axis=1).reshape(B, A, S) > 0) & (positions < T)
    valid = valid & keep[..., None]
    inputs = mx.where(offsets == 0, labels[..., :1], head.config.mask_token_id)  # (B, A, S)
    visible = mx.arange(T)[None, None, :] < starts[..., None]  # (B, A, T)
    rows = head.context(feats.astype(embed.dtype))  # (B, T, h)
    out = head.blocks(embed[inputs.reshape(B, A * S)], rows, positions.reshape(B, A * S), visible)
    out = out.reshape(B, A, S, -1)[:, :, 1:].reshape(B * A * (S - 1), -1)
    logits = out @ lm_head.T  # (B A (S - 1), V)
    labels, valid = labels[:, :, 1:].reshape(-1), valid[:, :, 1:]
    decay = mx.exp(-mx.arange(S - 1, dtype=mx.float32) / gamma)
    w = (valid * decay).reshape(-1)
    picked = mx.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    ce = _logsumexp(logits) - picked
    first = valid[:, :, 0].reshape(-1).astype(mx.float32)
    right = (mx.argmax(logits, axis=-1) == labels).reshape(B * A, S - 1)[:, 0]
    return _mean(ce, w), (mx.sum(right * first), mx.sum(first))
