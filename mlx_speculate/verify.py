"""Acceptance rules for speculative decoding, on logits alone (no models).

Chain rules (`greedy_accept`, `rejection_accept`) are lazy MLX graphs, so a decoding step can
`mx.eval` once. Tree rules run on the host after that one sync; they read only the rows they need.
Log-probabilities are expected as produced by `sampling.log_probs` (-inf for removed tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_speculate.sampling import sample


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying a chain of k draft tokens (leading batch axes allowed)."""

    tokens: mx.array  # (..., k + 1) int32; tokens[..., : num_accepted + 1] are emitted
    num_accepted: mx.array  # (...) int32, in [0, k]


@dataclass(frozen=True)
class TreeAcceptance:
    """Outcome of verifying a draft tree: the accepted node path and the token that follows it."""

    path: tuple[int, ...]  # node indices, starting at the root 0
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def greedy_accept(draft: mx.array, target_logits: mx.array) -> Acceptance:
    """Longest draft prefix matching the target's argmax, then the target's own next token.

    draft: (..., k) int; target_logits: (..., k + 1, V), row i predicting the token after draft[:i].
    """
    target = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # (..., k + 1)
    num_accepted = _leading_run(draft == target[..., :-1])
    # Accepted drafts equal the argmax, so the argmax row already holds every token to emit.
    return Acceptance(target, num_accepted)


def rejection_accept(
    draft: mx.array,
    draft_logprobs: mx.array,
    target_logprobs: mx.array,
    key: mx.array | None = None,
) -> Acceptance:
    """Lossless speculative sampling (Leviathan et al. 2023) for a chain.

    draft: (..., k) tokens, draft[i] drawn from draft_logprobs[i] (..., k, V); target_logprobs:
    (..., k + 1, V). Accept draft[i] with probability min(1, p(x)/q(x)); at the first rejection
    emit a sample from norm(max(0, p - q)), or after k acceptances a bonus sample from p_k.
    """
    k = draft.shape[-1]
    accept_key, sample_key = mx.random.split(key) if key is not None else (None, None)
    index = draft.astype(mx.int32)[..., None]  # (..., k, 1)
    target = target_logprobs[..., :k, :]  # (..., k, V)
    p_x = mx.take_along_axis(target, index, axis=-1)[..., 0]  # (..., k)
    q_x = mx.take_along_axis(draft_logprobs, index, axis=-1)[..., 0]  # (..., k)
    u = mx.random.uniform(shape=p_x.shape, key=accept_key)
    # u < p/q in log space: p = 0 always rejects, q = 0 < p accepts, and no 0/0 arises.
    num_accepted = _leading_run(mx.log(u) + q_x < p_x)

    residual = mx.maximum(mx.exp(target) - mx.exp(draft_logprobs), 0.0)  # (..., k, V)
    # A row with p <= q everywhere (p == q) cannot reject; p keeps its sample finite.
    has_mass = mx.any(residual > 0, axis=-1, keepdims=True)
    residual = mx.where(has_mass, mx.log(residual), target)
    fallback = mx.concatenate([residual, target_logprobs[..., k:, :]], axis=-2)  # (..., k + 1, V)
    # One draw per position keeps the graph static; only the one at num_accepted is used.
    correction = mx.take_along_axis(
        sample(fallback, sample_key), num_accepted[..., None], axis=-1
    )  # (..., 1)
    padded = mx.concatenate([draft.astype(mx.int32), correction], axis=-1)  # (..., k + 1)
    positions = mx.arange(k + 1)
    tokens = mx.where(positions == num_accepted[..., None], correction, padded)
    return Acceptance(tokens, num_accepted)


def greedy_tree_accept(
    parents: Sequence[int], tokens: mx.array | np.ndarray, target_logits: mx.array | np.ndarray
) -> TreeAcceptance:
    """Deepest node whose path tokens all equal the target's argmax at their parents.

    parents: BFS order with parents[0] == -1; tokens: (N,) with tokens[0] the root (the last
    committed token); target_logits: (N, V), row i predicting the token after node i. Siblings are
    assumed to hold distinct tokens (true of top-k drafts), so at most one child matches and the
    path is unique; otherwise the first deepest match in BFS order wins.
    """
    tokens = _check_tree(parents, tokens, target_logits)
    best = np.asarray(mx.argmax(mx.array(target_logits), axis=-1))  # (N,): only N ints cross
    ok = [True] * len(parents)
    for i in range(1, len(parents)):
        ok[i] = ok[parents[i]] and tokens[i] == best[parents[i]]
    last = _deepest(parents, ok, score=[0.0] * len(parents))
    return TreeAcceptance(_path_to(parents, last), int(best[last]))


def tree_rejection_accept(
    parents: Sequence[int],
    tokens: mx.array | np.ndarray,
    target_logprobs: mx.array | np.ndarray,
    draft_logprobs: mx.array | np.ndarray | None,
    rng: np.random.Generator,
) -> TreeAcceptance:
    """Lossless multi-candidate rejection sampling down a draft tree (SpecInfer, EAGLE).

    At each node its children are tried in order. With draft_logprobs None the children are
    deterministic picks (e.g. top-k): accept x with probability p(x), else set p(x) = 0 and
    renormalise. Otherwise draft_logprobs (N, V) row i is the distribution node i's children were
    drawn from i.i.d.: accept with min(1, p(x)/q(x)), else p <- norm(max(0, p - q)). When no child
    is accepted, or at a leaf, next_token is drawn from the current (residual) p.
    """
    tokens = _check_tree(parents, tokens, target_logprobs)
    children = _children(parents)
    path = [0]
    while True:
        node = path[-1]
        p = _host_probs(target_logprobs, node)  # (V,) float64
        q = None if draft_logprobs is None else _host_probs(draft_logprobs, node)
        for child in children[node]:
            x = tokens[child]
            if q is None:
                if rng.random() < p[x]:
                    break
                rest = p.copy()
                rest[x] = 0.0
            else:
                if rng.random() * q[x] < p[x]:
                    break
                rest = np.maximum(p - q, 0.0)
            # A residual with no mass is only reached through rounding; p stays a valid fallback.
            total = rest.sum()
            p = rest / total if total > 0 else p
        else:
            return TreeAcceptance(tuple(path), int(rng.choice(len(p), p=p)))
        path.append(child)


def typical_tree_accept(
    parents: Sequence[int],
    tokens: mx.array | np.ndarray,
    target_logprobs: mx.array | np.ndarray,
    threshold: float = 0.09,
    alpha: float = 0.3,
) -> TreeAcceptance:
    """Medusa's typical acceptance. LOSSY: the output does not follow the target distribution.

    Opt-in only. A node is accepted when its parent's p(x) > min(threshold, alpha * exp(-H(p))) and
    its parent is accepted; the deepest accepted node wins (ties: higher path log-likelihood), and
    next_token is the argmax after it.
    """
    tokens = _check_tree(parents, tokens, target_logprobs)
    logprobs = mx.array(target_logprobs).astype(mx.float32)  # (N, V)
    probs = mx.exp(logprobs)
    entropy = -mx.sum(mx.where(probs > 0, probs * logprobs, 0.0), axis=-1)  # (N,)
    cutoff = mx.minimum(threshold, alpha * mx.exp(-entropy))  # (N,)
    rows = mx.array(list(parents[1:]), dtype=mx.int32)
    candidate = logprobs[rows, mx.array(tokens[1:])]  # (N - 1,) log p of each node's token
    passed = mx.exp(candidate) > cutoff[rows]
    best = mx.argmax(logprobs, axis=-1)
    mx.eval(candidate, passed, best)
    candidate, passed, best = np.asarray(candidate), np.asarray(passed), np.asarray(best)

    ok = [True] * len(parents)
    score = [0.0] * len(parents)
    for i in range(1, len(parents)):
        ok[i] = ok[parents[i]] and bool(passed[i - 1])
        score[i] = score[parents[i]] + float(candidate[i - 1])
    last = _deepest(parents, ok, score)
    return TreeAcceptance(_path_to(parents, last), int(best[last]))


def _leading_run(ok: mx.array) -> mx.array:
    """Length of the leading run of True along the last axis: (..., k) -> (...) int32."""
    return mx.sum(mx.cumprod(ok.astype(mx.int32), axis=-1), axis=-1).astype(mx.int32)


def _check_tree(
    parents: Sequence[int], tokens: mx.array | np.ndarray, rows: mx.array | np.ndarray
) -> np.ndarray:
    tokens = np.asarray(tokens)
    n = len(parents)
    if n == 0 or parents[0] != -1:
        raise ValueError("a tree needs a root: parents[0] must be -1")
    if tokens.shape != (n,) or rows.shape[0] != n:
        raise ValueError(
            f"tree of {n} nodes got tokens of shape {tuple(tokens.shape)} "
            f"and logits of shape {tuple(rows.shape)}"
        )
    if tokens.min() < 0 or tokens.max() >= rows.shape[-1]:
        raise ValueError(f"tree tokens must lie in [0, {rows.shape[-1]}), got {tokens.tolist()}")
    return tokens


def _children(parents: Sequence[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].append(i)
    return children


def _deepest(parents: Sequence[int], ok: list[bool], score: list[float]) -> int:
    """Deepest accepted node; ties go to the higher score, then to the earlier node."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    accepted = [i for i in range(len(parents)) if ok[i]]
    return max(accepted, key=lambda i: (depth[i], score[i], -i))


def _path_to(parents: Sequence[int], node: int) -> tuple[int, ...]:
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return tuple(reversed(path))


def _host_probs(logprobs: mx.array | np.ndarray, row: int) -> np.ndarray:
    """Row `row` as float64 probabilities on the host, renormalised against float32 drift."""
    lp = logprobs[row]
    if isinstance(lp, mx.array):
        lp = lp.astype(mx.float32)  # numpy cannot read bfloat16
    lp = np.asarray(lp, dtype=np.float64)  # (V,)
    p = np.exp(lp - lp.max())
    return p / p.sum()
