"""Acceptance rules for speculative decoding, on logits alone (no models).

Every rule verifies a draft `Tree` (a chain is `Tree.chain(k)`, a plain step the root alone) and
returns one `Acceptance`. Rules are lazy MLX graphs with static shapes, so a decoding step needs
one `mx.eval` for drafting, verifying and accepting together; leading batch axes are allowed.

Shapes: N tree nodes, node 0 the root (the pending token); `draft` (..., N - 1) holds the tokens
of nodes 1..N-1 (-1 for the padding nodes of a `PaddedTree`, which no rule accepts); target
rows (..., N, V), row i predicting the token after node i. Draft rows,
where a rule reads them, are by parent: row i is the distribution node i's children were drawn
from (a chain of k drafts needs rows 0..k-1). Log-probabilities are as `sampling.log_probs`
makes them (-inf for removed tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .sampling import SamplingParams, log_probs, sample
from .tree import PaddedTree, Tree

# Added to the sort keys of nodes off the accepted path (`_path`): past any tree's size.
_OFF_PATH = 1 << 30


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying a draft tree of depth D (leading batch axes allowed)."""

    path: mx.array  # (..., D + 1) int32 node indices from the root; [: num_accepted + 1] is
    # the accepted path, ascending (the rest is padding)
    tokens: mx.array  # (..., D + 1) int32; [: num_accepted + 1] are emitted: the accepted
    # drafts, then the target's own token
    num_accepted: mx.array  # (...) int32, in [0, D]


@dataclass(frozen=True)
class AcceptanceRule:
    """The rule of one generation, chosen once from its settings: greedy, lossless rejection
    sampling, or Medusa's typical acceptance (LOSSY, opt-in). Hashable, so that compiled
    steps are keyed by it; `sampling` carries no seed (the generator is seeded once, outside)."""

    sampling: SamplingParams
    typical: bool = False

    @property
    def reads_draft(self) -> bool:
        """Whether the rule reads the draft's distributions (rejection sampling does)."""
        return not self.sampling.greedy and not self.typical

    def __call__(
        self,
        tree: Tree | PaddedTree,
        draft: mx.array,
        target_logits: mx.array,
        draft_logprobs: mx.array | None = None,
    ) -> Acceptance:
        if self.sampling.greedy:
            return greedy_accept(tree, draft, target_logits)
        target = log_probs(target_logits, self.sampling)
        if self.typical:
            return typical_accept(tree, draft, target)
        return rejection_accept(tree, draft, target, draft_logprobs)


def greedy_accept(tree: Tree | PaddedTree, draft: mx.array, target_logits: mx.array) -> Acceptance:
    """The deepest node whose path tokens all equal the target's argmax at their parents, then
    the target's argmax after it. Ties between equally deep nodes go to the first in node order
    (top-k siblings are distinct, so at most one child can match)."""
    best = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # (..., N)
    if tree.num_nodes == 1:
        return _root_only(best[..., 0])
    if tree.is_chain:  # the accepted path is the leading run of matches: fewer ops per step
        num_accepted = _leading_run(draft.astype(mx.int32) == best[..., :-1])  # -1 never
        path = mx.broadcast_to(mx.arange(tree.num_nodes, dtype=mx.int32), best.shape)
        return Acceptance(path, best, num_accepted)
    expected = mx.take(best, tree.parent_index[1:], axis=-1)  # (..., N - 1)
    match = _with_root(draft.astype(mx.int32) == expected)  # (..., N)
    path, num_accepted = _path(tree, _deepest(tree, _all_ancestors(tree, match)))
    # The accepted drafts equal the argmax at their parents: the argmax along the path holds
    # every token to emit.
    return Acceptance(path, mx.take_along_axis(best, path, axis=-1), num_accepted)


def rejection_accept(
    tree: Tree | PaddedTree,
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
    lead, n = probs.shape[:-2], tree.num_nodes
    q_rows = None if draft_logprobs is None else mx.exp(draft_logprobs.astype(mx.float32))
    tokens = _with_root(mx.maximum(draft, 0))  # (..., N) gather-safe
    real = _with_root(draft >= 0, fill=False)  # (..., N) drafted nodes, not padding
    index = mx.arange(n, dtype=mx.int32)
    # Siblings sharing a token (only possible with sampled children): the later ones are
    # tried against a residual that already excludes it.
    same = (tokens[..., :, None] == tokens[..., None, :]) & (index[:, None] > index[None, :])
    u = mx.random.uniform(shape=(*lead, max(tree.depth, 1), n if q_rows is None else tree.width))
    node = mx.zeros(lead, dtype=mx.int32)  # where the walk stands
    p = probs[..., 0, :]  # (..., V) the (residual) target distribution at `node`
    alive = mx.ones(lead, dtype=mx.bool_)  # still descending
    for d in range(tree.depth):
        children = alive[..., None] & real & (tree.parent_index == node[..., None])  # (..., N)
        if q_rows is None:
            nxt, moved, p = _deterministic_level(p, tokens, children, same, u[..., d, :])
        else:
            row = mx.minimum(node, q_rows.shape[-2] - 1)[..., None, None]
            q = mx.take_along_axis(q_rows, row, axis=-2)[..., 0, :]  # (..., V)
            nxt, moved, p = _sampled_level(p, q, tokens, children, u[..., d, :], tree.width)
        node = mx.where(moved, nxt, node)
        after = mx.take_along_axis(probs, node[..., None, None], axis=-2)[..., 0, :]
        p = mx.where(moved[..., None], after, p)
        alive = moved
    path, num_accepted = _path(tree, node)
    return Acceptance(path, _emitted(draft, path, num_accepted, sample(mx.log(p))), num_accepted)


def _deterministic_level(
    p: mx.array, tokens: mx.array, children: mx.array, same: mx.array, u: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """One level of deterministic children (top-k, n-gram) in O(nodes + vocabulary), as the
    official EAGLE code does: child j, tried after its earlier siblings were rejected, is
    accepted with probability p(x_j) / (1 - mass of the earlier siblings' tokens), the
    sequential rule in closed form; the first accepted child wins. With none accepted, the
    residual is p without every child's token, renormalised. Returns (child, moved, residual)."""
    p_x = mx.take_along_axis(p, tokens, axis=-1)  # (..., N)
    first = children & ~mx.any(same & children[..., None, :], axis=-1)  # first of its token
    taken = mx.cumsum(mx.where(first, p_x, 0.0), axis=-1, inclusive=False)  # earlier mass
    accept = first & (u * mx.maximum(1.0 - taken, 0.0) < p_x)
    moved = mx.any(accept, axis=-1)
    child = mx.argmax(accept, axis=-1).astype(mx.int32)
    rest = _without(p, tokens, children)
    return child, moved, rest


def _sampled_level(
    p: mx.array, q: mx.array, tokens: mx.array, children: mx.array, u: mx.array, width: int
) -> tuple[mx.array, mx.array, mx.array]:
    """One level of children drawn i.i.d. from q, tried in order: accept x with
    min(1, p(x) / q(x)), else p <- norm(max(0, p - q)) (each rejection changes p, so siblings
    go one at a time). Returns (child, moved, residual)."""
    rank = mx.cumsum(children.astype(mx.int32), axis=-1) - 1  # (..., N) rank among siblings
    moved = mx.zeros(p.shape[:-1], dtype=mx.bool_)
    child = mx.zeros(p.shape[:-1], dtype=mx.int32)
    for s in range(width):
        is_s = children & (rank == s)
        valid = mx.any(is_s, axis=-1) & ~moved
        candidate = mx.argmax(is_s, axis=-1).astype(mx.int32)
        x = mx.take_along_axis(tokens, candidate[..., None], axis=-1)  # (..., 1)
        p_x = mx.take_along_axis(p, x, -1)[..., 0]
        accept = valid & (u[..., s] * mx.take_along_axis(q, x, -1)[..., 0] < p_x)
        p = mx.where((valid & ~accept)[..., None], _normalised(mx.maximum(p - q, 0.0), p), p)
        child = mx.where(accept, candidate, child)
        moved = moved | accept
    return child, moved, p


def _without(p: mx.array, tokens: mx.array, drop: mx.array) -> mx.array:
    """(..., V) p with the tokens where `drop` holds set to 0, renormalised (a scatter: no
    (N, V) intermediate)."""
    keep = mx.where(drop, 0.0, 1.0)  # (..., N)
    flat = p.reshape(-1, p.shape[-1])
    rows = mx.arange(flat.shape[0])[:, None]
    zeroed = flat.at[rows, tokens.reshape(flat.shape[0], -1)].multiply(
        keep.reshape(flat.shape[0], -1)
    )
    return _normalised(zeroed.reshape(p.shape), p)


def _normalised(rest: mx.array, fallback: mx.array) -> mx.array:
    # A residual with no mass is only reached through rounding; p stays a valid fallback.
    total = mx.sum(rest, axis=-1, keepdims=True)
    return mx.where(total > 0, rest / mx.maximum(total, 1e-30), fallback)


def typical_accept(
    tree: Tree | PaddedTree,
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
    safe = mx.maximum(draft.astype(mx.int32), 0)[..., None]
    candidate = mx.take_along_axis(rows, safe, -1)[..., 0]
    passed = mx.exp(candidate) > mx.take(cutoff, parents, axis=-1)  # (..., N - 1)
    passed = passed & (draft >= 0)  # padding nodes
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
    on_path = mx.take(tree.ancestors, last, axis=0)  # (..., N)
    index = mx.arange(tree.num_nodes, dtype=mx.int32)
    # Path nodes first, in node order (ancestors precede descendants), then the others. The
    # offset is one for every tree: a constant that varied with the tree's size would be
    # inlined into a kernel compiled anew for each size.
    path = mx.argsort(mx.where(on_path, index, index + _OFF_PATH), axis=-1)[..., : tree.depth + 1]
    return path.astype(mx.int32), mx.take(tree.depth_index, last)


def _emitted(
    draft: mx.array, path: mx.array, num_accepted: mx.array, following: mx.array
) -> mx.array:
    """(..., D + 1): the draft tokens along the path, then `following` at `num_accepted`."""
    drafted = mx.take_along_axis(draft.astype(mx.int32), mx.maximum(path[..., 1:] - 1, 0), -1)
    following = following.astype(mx.int32)[..., None]
    tokens = mx.concatenate([drafted, following], axis=-1)
    return mx.where(mx.arange(path.shape[-1]) == num_accepted[..., None], following, tokens)
