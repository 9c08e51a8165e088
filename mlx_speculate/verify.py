"""Acceptance rules for speculative decoding, on logits alone (no models).

Every rule verifies a draft `Tree` (a chain is `Tree.chain(k)`, a plain step the root alone) and
returns one `Acceptance`. Rules are lazy MLX graphs with static shapes, so a decoding step needs
one `mx.eval` for drafting, verifying and accepting together; leading batch axes are allowed.

Shapes: N tree nodes, node 0 the root (the pending token); `draft` (..., N - 1) holds the tokens
of nodes 1..N-1; target rows (..., N, V), row i predicting the token after node i. Draft rows,
where a rule reads them, are by parent: row i is the distribution node i's children were drawn
from (a chain of k drafts needs rows 0..k-1). Log-probabilities are as `sampling.log_probs`
makes them (-inf for removed tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .sampling import sample
from .tree import Tree


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying a draft tree of depth D (leading batch axes allowed)."""

    path: mx.array  # (..., D + 1) int32 node indices from the root; [: num_accepted + 1] is
    # the accepted path, ascending (the rest is padding)
    tokens: mx.array  # (..., D + 1) int32; [: num_accepted + 1] are emitted: the accepted
    # drafts, then the target's own token
    num_accepted: mx.array  # (...) int32, in [0, D]


def greedy_accept(tree: Tree, draft: mx.array, target_logits: mx.array) -> Acceptance:
    """The deepest node whose path tokens all equal the target's argmax at their parents, then
    the target's argmax after it. Ties between equally deep nodes go to the first in node order
    (top-k siblings are distinct, so at most one child can match)."""
    best = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # (..., N)
    if tree.num_nodes == 1:
        return _root_only(best[..., 0])
    if tree.is_chain:  # the accepted path is the leading run of matches: fewer ops per step
        num_accepted = _leading_run(draft.astype(mx.int32) == best[..., :-1])
        path = mx.broadcast_to(mx.arange(tree.num_nodes, dtype=mx.int32), best.shape)
        return Acceptance(path, best, num_accepted)
    expected = mx.take(best, tree.parent_index[1:], axis=-1)  # (..., N - 1)
    match = _with_root(draft.astype(mx.int32) == expected)  # (..., N)
    path, num_accepted = _path(tree, _deepest(tree, _all_ancestors(tree, match)))
    # The accepted drafts equal the argmax at their parents: the argmax along the path holds
    # every token to emit.
    return Acceptance(path, mx.take_along_axis(best, path, axis=-1), num_accepted)


def rejection_accept(
    tree: Tree,
    draft: mx.array,
    target_logprobs: mx.array,
    draft_logprobs: mx.array | None = None,
) -> Acceptance:
    """Lossless speculative sampling down a draft tree (Leviathan et al. for a chain; SpecInfer
    and EAGLE for trees): the emitted tokens follow the target's distribution exactly.

    From the root, each node's children are tried in order. With `draft_logprobs` None the
    children are deterministic picks (top-k, n-gram lookup): accept x with probability p(x),
    else set p(x) = 0 and renormalise. Otherwise the children were drawn i.i.d. from their
    parent's row q: accept with min(1, p(x)/q(x)), else p <- norm(max(0, p - q)). When no child
    is accepted, or at a leaf, the target's token is drawn from the current (residual) p.
    """
    if tree.num_nodes == 1:  # a plain step: nothing to accept
        return _root_only(sample(target_logprobs[..., 0, :]))
    probs = mx.exp(target_logprobs.astype(mx.float32))  # (..., N, V)
    draft = draft.astype(mx.int32)
    lead = probs.shape[:-2]
    q_rows = None if draft_logprobs is None else mx.exp(draft_logprobs.astype(mx.float32))
    table = tree.child_table  # (N, S)
    depth, width = tree.depth, table.shape[1]
    u = mx.random.uniform(shape=(*lead, max(depth, 1), width))
    vocab = mx.arange(probs.shape[-1])
    node = mx.zeros(lead, dtype=mx.int32)  # where the walk stands
    p = probs[..., 0, :]  # (..., V) the (residual) target distribution at `node`
    alive = mx.ones(lead, dtype=mx.bool_)  # still descending
    for d in range(depth):
        moved = mx.zeros(lead, dtype=mx.bool_)
        nxt = node
        q = None
        if q_rows is not None:
            row = mx.minimum(node, q_rows.shape[-2] - 1)[..., None, None]
            q = mx.take_along_axis(q_rows, row, axis=-2)[..., 0, :]  # (..., V)
        for s in range(width):
            child = mx.take(table[:, s], node)  # (...) -1 past the last child
            valid = alive & ~moved & (child >= 0)
            x = mx.take_along_axis(draft, mx.maximum(child - 1, 0)[..., None], -1)  # (..., 1)
            p_x = mx.take_along_axis(p, x, -1)[..., 0]
            if q is None:
                accept = u[..., d, s] < p_x
                rest = mx.where(vocab == x, 0.0, p)
            else:
                accept = u[..., d, s] * mx.take_along_axis(q, x, -1)[..., 0] < p_x
                rest = mx.maximum(p - q, 0.0)
            # A residual with no mass is only reached through rounding; p stays a valid fallback.
            total = mx.sum(rest, axis=-1, keepdims=True)
            rest = mx.where(total > 0, rest / mx.maximum(total, 1e-30), p)
            p = mx.where((valid & ~accept)[..., None], rest, p)
            accept = valid & accept
            nxt = mx.where(accept, child, nxt)
            moved = moved | accept
        node = nxt
        after = mx.take_along_axis(probs, node[..., None, None], axis=-2)[..., 0, :]
        p = mx.where(moved[..., None], after, p)
        alive = moved
    path, num_accepted = _path(tree, node)
    return Acceptance(path, _emitted(draft, path, num_accepted, sample(mx.log(p))), num_accepted)


def typical_accept(
    tree: Tree,
    draft: mx.array,
    target_logprobs: mx.array,
    threshold: float = 0.09,
    alpha: float = 0.3,
) -> Acceptance:
    """Medusa's typical acceptance. LOSSY: the output does not follow the target distribution.

    Opt-in only. A node is accepted when its parent's p(x) > min(threshold, alpha * exp(-H(p)))
    and its parent is accepted; the deepest accepted node wins (ties: the higher path
    log-likelihood), and the target's token after it is its argmax.
    """
    logprobs = target_logprobs.astype(mx.float32)  # (..., N, V)
    best = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # (..., N)
    if tree.num_nodes == 1:
        return _root_only(best[..., 0])
    probs = mx.exp(logprobs)
    entropy = -mx.sum(mx.where(probs > 0, probs * logprobs, 0.0), axis=-1)  # (..., N)
    cutoff = mx.minimum(threshold, alpha * mx.exp(-entropy))  # (..., N)
    parents = tree.parent_index[1:]
    rows = mx.take(logprobs, parents, axis=-2)  # (..., N - 1, V)
    candidate = mx.take_along_axis(rows, draft.astype(mx.int32)[..., None], -1)[..., 0]
    passed = mx.exp(candidate) > mx.take(cutoff, parents, axis=-1)  # (..., N - 1)
    ok = _all_ancestors(tree, _with_root(passed))
    # Path log-likelihood; failed nodes count 0 so no -inf * 0 reaches the sum (they are not ok).
    gain = _with_root(mx.where(passed, candidate, 0.0), fill=0.0)  # (..., N)
    score = gain @ tree.ancestors.astype(mx.float32).T  # (..., N)
    depth = mx.where(ok, tree.depth_index, -1)
    deepest = ok & (depth == mx.max(depth, axis=-1, keepdims=True))
    last = mx.argmax(mx.where(deepest, score, -mx.inf), axis=-1).astype(mx.int32)
    path, num_accepted = _path(tree, last)
    following = mx.take_along_axis(best, last[..., None], axis=-1)[..., 0]
    return Acceptance(path, _emitted(draft, path, num_accepted, following), num_accepted)


def _root_only(token: mx.array) -> Acceptance:
    zeros = mx.zeros(token.shape, dtype=mx.int32)
    return Acceptance(zeros[..., None], token.astype(mx.int32)[..., None], zeros)


def _leading_run(ok: mx.array) -> mx.array:
    """Length of the leading run of True along the last axis: (..., k) -> (...) int32."""
    return mx.sum(mx.cumprod(ok.astype(mx.int32), axis=-1), axis=-1).astype(mx.int32)


def _with_root(values: mx.array, fill: bool | float = True) -> mx.array:
    """(..., N - 1) per non-root node -> (..., N) with `fill` at the root."""
    root = mx.full((*values.shape[:-1], 1), fill, dtype=values.dtype)
    return mx.concatenate([root, values], axis=-1)


def _all_ancestors(tree: Tree, ok: mx.array) -> mx.array:
    """(..., N): True where `ok` holds at the node and at every ancestor."""
    return mx.all(mx.where(tree.ancestors, ok[..., None, :], True), axis=-1)


def _deepest(tree: Tree, ok: mx.array) -> mx.array:
    """(...) int32: the first deepest node where `ok` holds (the root always does)."""
    return mx.argmax(mx.where(ok, tree.depth_index, -1), axis=-1).astype(mx.int32)


def _path(tree: Tree, last: mx.array) -> tuple[mx.array, mx.array]:
    """(..., D + 1) node indices from the root to `last` (then padding), and its depth."""
    n = tree.num_nodes
    on_path = mx.take(tree.ancestors, last, axis=0)  # (..., N)
    index = mx.arange(n, dtype=mx.int32)
    # Path nodes first, in node order (ancestors precede descendants), then the others.
    path = mx.argsort(mx.where(on_path, index, n + index), axis=-1)[..., : tree.depth + 1]
    return path.astype(mx.int32), mx.take(tree.depth_index, last)


def _emitted(
    draft: mx.array, path: mx.array, num_accepted: mx.array, following: mx.array
) -> mx.array:
    """(..., D + 1): the draft tokens along the path, then `following` at `num_accepted`."""
    drafted = mx.take_along_axis(draft.astype(mx.int32), mx.maximum(path[..., 1:] - 1, 0), -1)
    following = following.astype(mx.int32)[..., None]
    tokens = mx.concatenate([drafted, following], axis=-1)
    return mx.where(mx.arange(path.shape[-1]) == num_accepted[..., None], following, tokens)
