"""EAGLE-1/2/3: a draft head over the target's own features grows a dynamic tree (EAGLE-2).

The one-token shift: draft position t reads the target's features of position t and the
embedding of token t+1, and predicts token t+2. Features of committed positions arrive through
`extend`; a proposal first runs the head over the positions it has not seen (their next tokens
are all in the context, the pending one last), which leaves the head's state at the last
committed position: its prediction is the root's children.

The tree (EAGLE-2, SafeAILab/EAGLE `topK_genrate`): the root's `top_k` best tokens, then for
`depth` levels the `top_k` best-scoring frontier nodes are run through the head at once (tree
mask over the draft cache) and each proposes its `top_k` best children; a node's score is the
cumulative draft log-probability of its path. The best `k` nodes of all candidates (k from the
policy, at most `total - 1`) are verified, and the children of a node being deterministic
top-k picks, tree rejection sampling stays lossless. The selection runs on the device
(`select`): the chosen tree's arrays feed the verify forward lazily, so a step's only host
sync is the acceptance read-back.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx

from ..cli import bounded, non_negative_int, positive_int
from ..heads.eagle import EagleHead
from ..heads.eagle_format import EAGLE_DIR, load_eagle_heads
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..step import cache_view, compiled
from ..tree import DeviceTree, Tree
from .base import Draft, DrafterSpec, TargetFeatures


@dataclass(frozen=True)
class EagleTree:
    """EAGLE-2's tree settings (the official defaults): nodes verified with the root, levels
    expanded, and children per node; `top_k` 1 makes a chain."""

    total: int = 60
    depth: int = 7
    top_k: int = 10

    def __post_init__(self) -> None:
        if self.total < 2 or self.depth < 0 or self.top_k < 1:
            raise ValueError(
                f"EAGLE tree needs total >= 2, depth >= 0 and top-k >= 1, got total "
                f"{self.total}, depth {self.depth}, top-k {self.top_k}"
            )

    @classmethod
    def chain(cls, k: int) -> EagleTree:
        """A chain of k drafts."""
        return cls(total=k + 1, depth=k - 1, top_k=1)


@dataclass(frozen=True, kw_only=True, eq=False)
class EagleSpec(DrafterSpec):
    """EAGLE heads drafting dynamic trees. `heads`: True for those beside the loaded model
    (`eagle/` in its folder), a heads folder, file or hub id in any published layout (SafeAILab
    EAGLE-1 or EAGLE-3, SpecForge, AngelSlim, speculators, or MLX), or an `EagleHead`.
    `tree` (keyword `eagle_tree=`): an `EagleTree`."""

    keywords: ClassVar[dict[str, str | None]] = {
        "eagle": "heads",
        "eagle_tree": "tree",
        "tree": "tree",  # the keyword before eagle_tree= existed: checked to be an EagleTree
    }
    flags: ClassVar[dict[str, str]] = {
        "eagle": "--eagle",
        "eagle_tree": "--tree-total/--tree-depth/--tree-top-k",
    }

    heads: bool | str | Path | EagleHead = True
    tree: EagleTree = EagleTree()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.tree, EagleTree):
            raise TypeError(
                f"eagle_tree must be an EagleTree (e.g. EagleTree(total=30)), got "
                f"{self.tree!r} (Medusa tree names go with medusa=)"
            )

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--eagle",
            nargs="?",
            const=True,
            default=False,
            metavar="DIR",
            help="draft dynamic trees with EAGLE-1/EAGLE-3 heads: those beside the model (its "
            "eagle/ folder), or the heads folder or hub id DIR (official or speculators layout)",
        )
        default = EagleTree()
        total = bounded(int, lambda v: v >= 2, ">= 2 (the root and at least one draft)")
        group.add_argument(
            "--tree-total",
            type=total,
            default=None,
            metavar="N",
            help=f"EAGLE: most nodes verified per step, the root included (default "
            f"{default.total})",
        )
        group.add_argument(
            "--tree-depth",
            type=non_negative_int,
            default=None,
            metavar="D",
            help=f"EAGLE: levels the tree grows per step (default {default.depth})",
        )
        group.add_argument(
            "--tree-top-k",
            type=positive_int,
            default=None,
            metavar="K",
            help=f"EAGLE: children per expanded node (default {default.top_k}; 1 drafts a chain)",
        )

    @classmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        shape = {"total": args.tree_total, "depth": args.tree_depth, "top_k": args.tree_top_k}
        shape = {k: v for k, v in shape.items() if v is not None}
        return {"eagle": args.eagle, "eagle_tree": EagleTree(**shape) if shape else None}

    def resolve(self, target: CausalLM) -> EagleSpec:
        heads = self.heads
        if isinstance(heads, EagleHead):
            return self
        if heads is True:
            if target.origin.folder is None or not (target.origin.folder / EAGLE_DIR).is_dir():
                raise ValueError(
                    "no EAGLE heads beside the model (convert it with --eagle-path, or name the "
                    "heads folder)"
                )
            heads = target.origin.folder / EAGLE_DIR
        if not isinstance(heads, str | Path):
            raise ValueError(f"EAGLE heads must be a folder or an EagleHead, got {heads!r}")
        return replace(self, heads=load_eagle_heads(heads, target))

    def build(self, target: CausalLM, tokenizer=None) -> EagleDrafter:
        heads = self.resolve(target).heads
        drafter = EagleDrafter(heads, target, heads.check_fits(target), self.tree)
        if self.num_draft_tokens is not None:
            drafter.max_draft = min(drafter.max_draft, self.num_draft_tokens)
        return drafter


class EagleDrafter:
    def __init__(self, head: EagleHead, target: CausalLM, taps: tuple[int, ...], tree: EagleTree):
        self.head = head
        self.target = target
        self.taps = taps
        self.settings = tree
        self.max_draft = tree.total - 1
        self.cache = head.make_cache()
        self._pending: list[mx.array] = []  # feature rows of committed positions not yet run
        self._fed = 0  # committed positions in the draft cache
        self._known = 0  # committed positions whose features it has: fed + pending
        self._last: mx.array | None = None  # (h,) the head's output at position _fed - 1

    def extend(self, features: TargetFeatures) -> None:
        rows = self.head.inputs(features.hidden, features.taps)
        self._pending.append(rows)
        self._known += rows.shape[0]

    def rewind(self, length: int) -> None:
        if length >= self._known:
            return
        if length >= self._fed:
            rows = mx.concatenate(self._pending)[: length - self._fed]
            self._pending = [rows] if rows.shape[0] else []
        else:
            self.cache.truncate(min(self.cache.offset, length))
            self._fed, self._pending, self._last = length, [], None
        self._known = length

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        committed = len(context) - 1
        k = min(k, self.max_draft)
        if k <= 0 or self._known != committed:
            return None
        self.cache.truncate(self._fed)  # the last proposal's tree slots
        if self._pending:
            features = mx.concatenate(self._pending)  # (m, F)
            tokens = mx.array(context[self._fed + 1 : committed + 1], dtype=mx.int32)  # (m,)
            out = self.head(
                self._embed(tokens)[None], features[None], self.cache, from_target=True
            )[0]
            self._last, self._fed, self._pending = out[-1], committed, []
        if self._last is None:
            return None
        return self._grow(committed, k)

    def _grow(self, committed: int, k: int) -> Draft:
        """The best k nodes of an EAGLE-2 tree below the pending token.

        Fixed shapes: the levels and the selection are one compiled graph per (top-k, depth,
        k, span) whose inputs are the head's state at the last committed position, the first
        tree slot and its position (arrays) and the head's cache, read over its leading span;
        each level's mask is a bool visibility over the tree's own slots. No host sync."""
        top_k = min(self.settings.top_k, k)
        depth = min(self.settings.depth, k - 1)  # deeper levels could not be among k nodes
        end = self._fed + depth * top_k
        self.cache.reserve(end)
        span = self.cache.span(end)
        key = ("eagle", id(self.target), top_k, depth, k, span)
        build = lambda: self._levels(top_k, depth, k, span)  # noqa: E731
        fn = compiled(self.head, key, build, traced=self.head.traceable)
        start, position = mx.array(self._fed, mx.int32), mx.array(committed, mx.int32)
        tokens, *tree = fn(self._last, start, position, *self.cache.state)
        layers = len(self.cache.state)
        tree, arrays = tree[: len(tree) - layers], tree[len(tree) - layers :]
        self.cache.set_arrays(arrays)
        self.cache.advance(depth * top_k)
        if top_k == 1:  # a chain: its first k nodes are its best ones
            return Draft(tokens, Tree.chain(tokens.shape[0]))
        return Draft(tokens, DeviceTree(k + 1, depth + 1, top_k, *tree))

    def _levels(self, top_k: int, depth: int, k: int, span: int) -> Callable:
        """The traced growth: (last, start, position, *cache) -> (tokens, the selected tree's
        parent, depth and ancestor arrays (trees only), *cache)."""

        def grow(last, start, position, *arrays):
            cache = cache_view(self.head, arrays, start, span)
            scores, ids = self._best(last[None], top_k)  # (1, top_k)
            tokens, scores = ids[0], scores[0]  # the root's children
            candidates = [(tokens, scores, mx.zeros((top_k,), dtype=mx.int32))]
            frontier = mx.arange(top_k, dtype=mx.int32)  # candidate indices of the frontier
            hidden = mx.broadcast_to(self.head.feedback(last), (top_k, last.shape[-1]))
            seen = mx.eye(top_k, dtype=mx.bool_)  # (top_k, tree slots) ancestors among fed nodes
            first = top_k  # index of the next level's first candidate
            for level in range(depth):
                cache.start = start + level * top_k
                out = self.head(
                    self._embed(tokens)[None],
                    hidden[None],
                    cache,
                    from_target=False,
                    positions=mx.broadcast_to(position + level, (top_k,)),
                    mask=seen,
                )[0]  # (top_k, h)
                child_scores, child_ids = self._best(out, top_k)  # (top_k, top_k)
                cumulative = (child_scores + scores[:, None]).reshape(-1)  # (top_k * top_k,)
                parents = mx.repeat(frontier + 1, top_k)  # node ids: candidate index + 1
                candidates.append((child_ids.reshape(-1), cumulative, parents))
                if level == depth - 1:
                    break
                best = mx.argsort(-cumulative)[:top_k].astype(mx.int32)
                rows = best // top_k
                tokens, scores = child_ids.reshape(-1)[best], cumulative[best]
                frontier, hidden = first + best, self.head.feedback(out)[rows]
                seen = mx.concatenate([seen[rows], mx.eye(top_k, dtype=mx.bool_)], axis=1)
                first += top_k * top_k
            tokens, scores, parents = (mx.concatenate(c) for c in zip(*candidates, strict=True))
            if top_k == 1:
                return tokens[:k], *cache.state
            levels = [mx.full((top_k,), 1, mx.int32)]
            levels += [mx.full((top_k * top_k,), d + 2, mx.int32) for d in range(depth)]
            tree, index = select(scores, parents, mx.concatenate(levels), k, depth + 1, top_k)
            return (
                tokens[index], tree.parent_index, tree.depth_index, tree.ancestors, *cache.state
            )

        return grow

    def _embed(self, tokens: mx.array) -> mx.array:
        return self.target.model.embed_tokens(tokens)

    def _best(self, out: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """(n, h) head outputs -> the k likeliest next tokens of each, best first: (n, k)
        log-probabilities and (n, k) target ids."""
        logits = self.head.logits(out, self.target).astype(mx.float32)  # the head's vocabulary
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
        scores = mx.take_along_axis(logits, ids, axis=-1)  # (n, k), normalised below
        scores = scores - mx.logsumexp(logits, axis=-1, keepdims=True)
        order = mx.argsort(-scores, axis=-1)
        ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
        return mx.take_along_axis(scores, order, axis=-1), self.head.to_target(ids)


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
