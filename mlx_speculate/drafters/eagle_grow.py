"""EAGLE's traced device work: the catch-up over a verified path and the EAGLE-2 tree growth.

Both run inside compiled graphs (the drafter's own growth graph, or the verify step's graph
when the step is fused: `catch_up_and_grow`), over a cache view whose slot start is an array,
so no shape depends on a host offset or on how many drafts the target accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from ..heads.eagle import EagleHead
from ..models.context import build_context
from ..tree import DeviceTree
from ..verify import Acceptance

Embed = Callable[[mx.array], mx.array]


def grow(
    head: EagleHead,
    embed: Embed,
    project: Callable[[mx.array], mx.array],
    last: mx.array,
    cache,
    start: mx.array,
    top_k: int,
    depth: int,
    k: int,
) -> tuple[mx.array, ...]:
    """The best k nodes of an EAGLE-2 tree below the pending token, from `last` (h,), the
    head's output at the last committed position, whose slot and rotary position is
    `start - 1`: the levels write from slot `start` on. Returns (tokens (k,), and for trees
    the selected tree's parent, depth and ancestor arrays); `cache.state` holds the writes."""
    if top_k == 1:
        return (chain(head, embed, project, last, cache, start, depth)[:k],)
    scores, ids = best(head, project, last[None], top_k)  # (1, top_k)
    tokens, scores = ids[0], scores[0]  # the root's children
    candidates = [(tokens, scores, mx.zeros((top_k,), dtype=mx.int32))]
    frontier = mx.arange(top_k, dtype=mx.int32)  # candidate indices of the frontier
    hidden = mx.broadcast_to(head.feedback(last), (top_k, last.shape[-1]))
    eye = mx.eye(top_k, dtype=mx.bool_)
    seen = eye  # (top_k, tree slots) ancestors among fed nodes
    first = top_k  # index of the next level's first candidate
    for level in range(depth):
        cache.start = start + level * top_k
        out = head(
            embed(tokens)[None],
            hidden[None],
            cache,
            from_target=False,
            positions=mx.broadcast_to(start + level, (top_k,)),
            mask=seen,
        )[0]  # (top_k, h)
        child_scores, child_ids = best(head, project, out, top_k)  # (top_k, top_k)
        cumulative = (child_scores + scores[:, None]).reshape(-1)  # (top_k * top_k,)
        parents = mx.repeat(frontier + 1, top_k)  # node ids: candidate index + 1
        candidates.append((child_ids.reshape(-1), cumulative, parents))
        if level == depth - 1:
            break
        chosen = mx.argsort(-cumulative)[:top_k].astype(mx.int32)
        rows = chosen // top_k
        tokens, scores = child_ids.reshape(-1)[chosen], cumulative[chosen]
        frontier, hidden = first + chosen, head.feedback(out)[rows]
        seen = mx.concatenate([seen[rows], eye], axis=1)
        first += top_k * top_k
    tokens, scores, parents = (mx.concatenate(c) for c in zip(*candidates, strict=True))
    levels = [mx.full((top_k,), 1, mx.int32)]
    levels += [mx.full((top_k * top_k,), d + 2, mx.int32) for d in range(depth)]
    tree, index = select(scores, parents, mx.concatenate(levels), k, depth + 1, top_k)
    return tokens[index], tree.parent_index, tree.depth_index, tree.ancestors


def chain(
    head: EagleHead,
    embed: Embed,
    project: Callable[[mx.array], mx.array],
    last: mx.array,
    cache,
    start: mx.array,
    depth: int,
) -> mx.array:
    """`grow` for a top-k of 1: the depth + 1 greedy drafts (no scores, no selection). Level
    i runs one row at slot and position start + i; the rows' rotations and causal masks are
    built once for all levels, and every level keeps (1, 1, ...) shapes: on an overhead-bound
    target each re-index or table would be a graph node a level."""
    ids = greedy(head, project, last[None, None])  # (1, 1)
    drafts, hidden = [ids], head.feedback(last)[None, None]
    cache.start = start
    if depth:
        levels = build_context(head.rope, cache, depth, None, None, None, (False,), last.dtype)
    for level in range(depth):
        ctx = levels.row(level, head.rope, last.dtype)
        out = head(embed(ids), hidden, cache, from_target=False, ctx=ctx)  # (1, 1, h)
        ids, hidden = greedy(head, project, out), head.feedback(out)
        drafts.append(ids)
    return mx.concatenate(drafts, axis=1).reshape(-1) if depth else ids.reshape(-1)


def greedy(head: EagleHead, project: Callable[[mx.array], mx.array], out: mx.array) -> mx.array:
    """(..., h) head outputs -> (...) their likeliest next target ids."""
    return head.to_target(mx.argmax(project(out), axis=-1).astype(mx.int32))


def catch_up_and_grow(
    head: EagleHead,
    embed: Embed,
    project: Callable[[mx.array], mx.array],
    acceptance: Acceptance,
    hidden: mx.array,
    taps: Sequence[mx.array],
    cache,
    fed: mx.array,
    top_k: int,
    depth: int,
    k: int,
) -> tuple[mx.array, ...]:
    """After a verify step's rule (traced in its graph): the head runs over the accepted
    path's positions, which sit from slot `fed` on, and grows the next tree from the last
    of them. Fixed shapes: every path row runs (the D + 1 of the tree's depth bound); rows
    past the accepted count write slots the next tree overwrites or never attends, and the
    count selects the last real row. Position `fed + i` reads the target's features of path
    node i and the embedding of the token emitted after it. Returns (last, the grown tree's
    arrays as `grow` gives them)."""
    path, n = acceptance.path, acceptance.num_accepted
    rows = head.inputs(hidden, taps)[path]  # (D + 1, F): one gather, not one per tap
    tokens = mx.maximum(acceptance.tokens, 0)  # a rejected sampled path may hold -1 padding
    cache.start = fed
    out = head(embed(tokens)[None], rows[None], cache, from_target=True).squeeze(0)  # (D + 1, h)
    last = mx.take(out, n, axis=0)
    return last, *grow(head, embed, project, last, cache, fed + n + 1, top_k, depth, k)


def best(
    head: EagleHead, project: Callable[[mx.array], mx.array], out: mx.array, k: int
) -> tuple[mx.array, mx.array]:
    """(n, h) head outputs -> the k likeliest next tokens of each, best first: (n, k)
    log-probabilities and (n, k) target ids."""
    logits = project(out).astype(mx.float32)  # the head's vocabulary
    ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    scores = mx.take_along_axis(logits, ids, axis=-1)  # (n, k), normalised below
    scores = scores - mx.logsumexp(logits, axis=-1, keepdims=True)
    order = mx.argsort(-scores, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    return mx.take_along_axis(scores, order, axis=-1), head.to_target(ids)


def select(
    scores: mx.array, parents: mx.array, depths: mx.array, k: int, depth: int, width: int
) -> tuple[DeviceTree, mx.array]:
    """EAGLE-2 on the device: the root and the k best-scoring of C candidates (scores are
    cumulative draft log-probs, so no child outscores its parent; ties go to the earlier
    candidate, so every kept node's ancestors are kept), as `Tree.from_scores` does on the
    host. `parents` are node ids (candidate index + 1, 0 the root), `depths` the candidates'.
    Returns the tree (its nodes in candidate order) and the kept candidates' indices (k,)."""
    c = scores.shape[0]
    index = mx.arange(c, dtype=mx.int32)
    ahead = (scores[None, :] > scores[:, None]) | (
        (scores[None, :] == scores[:, None]) & (index[None, :] < index[:, None])
    )  # (C, C): [i, j] when j ranks before i
    kept = mx.sum(ahead, axis=1) < k
    order = mx.argsort(mx.where(kept, index, c + index))[:k].astype(mx.int32)  # ascending
    renumber = mx.zeros((c + 1,), mx.int32).at[order + 1].add(mx.arange(1, k + 1, dtype=mx.int32))
    parent_index = mx.concatenate([mx.zeros((1,), mx.int32), renumber[parents[order]]])
    depth_index = mx.concatenate([mx.zeros((1,), mx.int32), depths[order]])
    eye = mx.eye(k + 1, dtype=mx.bool_)
    ancestors = eye
    for _ in range(depth):  # a node's row is itself plus its parent's row
        ancestors = eye | ancestors[parent_index]
    return DeviceTree(k + 1, depth, width, parent_index, depth_index, ancestors), order
