"""DFlash: a block drafter over the target's features drafts a whole block in one forward.

The drafter (heads/dflash.py) keeps the keys and values of every committed position's
context row (the target's tapped layer outputs, projected). A proposal writes the rows it has
not seen yet, then runs one non-causal forward over the block [pending token, mask, ..., mask]
at the next B positions; row i's output, through the target's lm_head, is the distribution of
the token i places after the pending one. Positions do not condition on each other's picks, so
every draft of a proposal comes from that one forward.

- A chain (`top_k` 1) of up to B - 1 tokens: greedy, each position's argmax; sampling, each
  position's token drawn from its processed distribution (`sampling.log_probs`, the
  target's settings), whose rows come back as `Draft.logprobs`, so rejection sampling keeps
  the target's distribution exactly (z-lab's reference verifies its chains so too).
- A tree (`top_k` > 1, as DDTree does): the best k nodes of the product tree whose node at
  depth d has the top_k likeliest tokens of position d as children, a node's score the sum
  of its path's draft log-probabilities. The beam keeps each level's top_k best nodes, which
  holds the best k nodes whenever no level needs more than top_k of them. Children are
  deterministic picks, so the tree rejection rule stays lossless at any temperature.

Fixed shapes: one compiled graph per (context rows' bucket, block, span, choice); the
context rows, the slot they start at and the pending token are inputs, so a proposal needs
no host sync. The tree is chosen on the device (`eagle_grow.select`).

A step can be fused (`then`, as EAGLE's): the verify step's graph writes the accepted path's
context rows and drafts the next block below the token the rule chose, so a step is one
compiled call and one host sync, and the next step can be queued on the lazy accepted count
(`follow`) before this one is read.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..cli import positive_int
from ..graphs import compiled
from ..heads.dflash import DFlashHead, features
from ..heads.dflash_format import DFLASH_DIR, load_dflash
from ..memo import from_folder
from ..models.base import CausalLM
from ..models.context import build_context
from ..sampling import SamplingParams, log_probs, sample
from ..step import Then, bucket, cache_view
from ..tree import DeviceTree, Tree
from .base import Draft, DrafterSpec, FusedDrafter, TargetFeatures
from .eagle_grow import select
from .features import FeatureQueue, FusedSteps


@dataclass(frozen=True, kw_only=True, eq=False)
class DFlashSpec(DrafterSpec):
    """A DFlash block drafter. `drafter`: True for the one beside the loaded model (`dflash/`
    in its folder), a drafter folder in z-lab's layout, or a `DFlashHead`. `top_k` (keyword
    `dflash_top_k=`): 1 drafts a chain of up to block_size - 1 tokens; more drafts a tree
    from each position's top_k tokens (DDTree), of as many nodes as the policy asks."""

    method: ClassVar[str] = "dflash"  # not the class name's "d_flash"
    keywords: ClassVar[dict[str, str | None]] = {"dflash": "drafter", "dflash_top_k": "top_k"}
    flags: ClassVar[dict[str, str]] = {"dflash": "--dflash", "dflash_top_k": "--dflash-top-k"}

    drafter: bool | str | Path | DFlashHead = True
    top_k: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"dflash_top_k must be an integer >= 1, got {self.top_k!r}")

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--dflash",
            nargs="?",
            const=True,
            default=False,
            metavar="DIR",
            help="draft blocks with a DFlash drafter: the one beside the model (its dflash/ "
            "folder), or the drafter folder DIR (z-lab's layout)",
        )
        group.add_argument(
            "--dflash-top-k",
            type=positive_int,
            default=None,
            metavar="K",
            help="DFlash: draft a tree from each block position's K likeliest tokens "
            "(default 1: a chain)",
        )

    @classmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"dflash": args.dflash, "dflash_top_k": args.dflash_top_k}

    def resolve(self, target: CausalLM) -> DFlashSpec:
        drafter = self.drafter
        if isinstance(drafter, DFlashHead):
            return self
        if drafter is True:
            folder = target.origin.folder
            if folder is None or not (folder / DFLASH_DIR).is_dir():
                raise ValueError(
                    "no DFlash drafter beside the model: name the drafter folder, or train one "
                    "with `python -m mlx_speculate.train dflash --model M --out DIR`"
                )
            drafter = folder / DFLASH_DIR
        if not isinstance(drafter, str | Path):
            raise ValueError(f"a DFlash drafter must be a folder or a DFlashHead, got {drafter!r}")
        loaded = from_folder(target, "dflash", drafter, lambda: load_dflash(drafter, target))
        return replace(self, drafter=loaded)

    def build(self, target: CausalLM, tokenizer=None) -> DFlashDrafter:
        head = self.resolve(target).drafter
        drafter = DFlashDrafter(head, target, self.top_k)
        if self.num_draft_tokens is not None:
            drafter.max_draft = min(drafter.max_draft, self.num_draft_tokens)
        return drafter


class DFlashDrafter(FusedDrafter):
    """Drafts blocks below the pending token from the context rows of every committed
    position; its cache holds their keys and values, slot = position.

    A fused step (`then`) writes the verified path's rows and drafts the next block in the
    verify step's graph; `settle` then takes the accepted count, and the next `propose` (a
    chain of any length, or a tree of the last one's size) returns that block's draft.
    Otherwise (the first step, a plain step between, another tree size) `propose` writes the
    waiting rows and drafts in a compiled graph of its own."""

    follows_context = False

    def __init__(self, head: DFlashHead, target: CausalLM, top_k: int = 1):
        self.taps = head.check_fits(target)
        self.head = head
        self.target = target
        self.block = head.config.block_size
        self.top_k = top_k
        depth = self.block - 1
        # A tree's nodes: every candidate of the beam (the root's top_k children, then
        # top_k * top_k a level), as many as the policy may ask for.
        self.max_draft = depth if top_k == 1 else top_k + (depth - 1) * top_k * top_k
        self.cache = head.make_cache(head.norm.weight.dtype)  # it computes in its own dtype
        self._features = FeatureQueue(self.cache)  # rows: the context rows of `features`
        self._choice: tuple | None = None  # the last proposal's (`_choice`)
        self._fused = FusedSteps(self._features)  # entries: (choice, the block's draft)
        mx.eval(head.parameters())

    def weights(self) -> tuple[nn.Module, ...]:
        return (self.head,)

    def extend(self, features_: TargetFeatures) -> None:
        self._features.add(features(features_.taps))

    def rewind(self, length: int) -> None:
        self._fused.rewind(length)

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        committed = len(context) - 1
        k = min(k, self.max_draft)
        ready = self._fused.take_ready()
        if k <= 0 or self._features.known != committed:
            return None
        choice = self._choice_of(k, sampling)
        if ready is not None and ready[0] == choice and not self._features.waiting:
            self._choice = choice
            return self._cut(ready[1], k)
        rows = self._features.rows()
        m = self._features.waiting
        padded = bucket(max(m, 1))
        width = features_width(self.head)
        if rows is None:
            rows = mx.zeros((padded, width), self.head.norm.weight.dtype)
        elif padded > m:
            rows = mx.concatenate([rows, mx.zeros((padded - m, width), rows.dtype)])
        # Context rows at slots fed.. (their padding past `committed` is overwritten by the
        # block or never attended), then the block at committed..committed + B - 1.
        end = max(self._features.fed + padded, committed + self.block)
        self.cache.reserve(end)
        span = self.cache.span(committed + self.block)
        key = ("dflash", id(self.head), padded, choice)
        build = lambda: _block_fn(self.head, self.target, span, choice)  # noqa: E731
        fn = compiled(self.head, key, build, traced=self.head.traceable, span=span)
        fed = mx.array(self._features.fed, mx.int32)
        pending = mx.array(context[-1:], mx.int32)
        out = fn(rows, fed, mx.array(committed, mx.int32), pending, *self.cache.state)
        layers = len(self.cache.state)
        draft = self._cut(self._draft(choice, out[: len(out) - layers]), k)
        if self._fused.queued:  # a queued fused step wrote past `fed`: leave its slots alone
            return draft
        self.cache.set_arrays(out[len(out) - layers :])
        self.cache.advance(committed - self.cache.offset)
        self._features.mark_fed(committed)
        self._choice = choice
        return draft

    def then(self) -> Then | None:
        """The next block, of the last proposal's choice, traced into the verify step of the
        last one (or, after `follow`, of the step queued on its count); None when the head
        cannot be traced. Fixed shapes: the verified tree's path rows (at most B: a draft
        has at most B - 1 tokens) from the path's first slot (an input), then the block."""
        start = self._fused.path_start()
        known = start is not None and self._choice is not None and not self._features.waiting
        if not known or not self.head.traceable:
            return None
        head, target, choice, block = self.head, self.target, self._choice, self.block
        end = start[1] + 2 * block  # the path's rows, then the block after them
        self.cache.reserve(end)
        span = self.cache.span(end)

        def trace(acceptance, hidden, taps, fed, *arrays):
            view = cache_view(head, arrays, fed, span)
            path, n = acceptance.path[:block], acceptance.num_accepted
            # (D + 1, F), D <= B - 1; a chain's path is its first rows (a slice, no gather)
            index = path if choice[0] == "tree" else slice(0, path.shape[0])
            rows = features(tuple(t[index] for t in taps))
            dtype = arrays[0].dtype
            head.write_context(head.context(rows[None].astype(dtype)), view, fed)
            pending = mx.take(mx.maximum(acceptance.tokens, 0), n.reshape(1))
            out = _block(head, target, view, fed + n + 1, pending, span, choice)
            return (*out, *view.state)

        key = ("dflash", id(head), span, choice)
        return Then(key, (start[0], *self.cache.state), trace)

    def received(self, outputs: Sequence[mx.array]) -> None:
        """The fused step's lazy outputs (`Verified.then`)."""
        draft = self._draft(self._choice, self.cache.take_outputs(outputs))
        self._fused.received(self._choice, draft)

    def follow(
        self,
        drafted: mx.array,
        accepted: mx.array,
        pending: mx.array,
        k: int,
        sampling: SamplingParams,
    ) -> Draft | None:
        """The block the fused step being verified drafted, for the step queued on the count
        of drafts it `accepted` (an int32 scalar) before that count is read: the next `then`
        writes the path from the slot after them. None unless exactly that step is
        unsettled and the next is of the same choice."""
        choice = self._choice_of(min(k, self.max_draft), sampling)
        sole = self._fused.sole()
        if sole is None or sole[0] != choice or not self.head.traceable:
            return None
        self._fused.follow(accepted, self.block - 1)  # a block drafts at most B - 1
        self._choice = choice
        return self._cut(sole[1], k)

    def settle(self, accepted: int) -> None:
        """The oldest fused step accepted `accepted` drafts: its path's rows are in the
        cache, and its block follows them (unless a step queued on this one's count took
        it already)."""
        self._fused.settle(accepted)

    def _choice_of(self, k: int, sampling: SamplingParams) -> tuple:
        """What shapes the block's graph besides its sizes: ("greedy",), ("sampled",
        settings) or ("tree", top_k, k)."""
        if self.top_k > 1:
            return ("tree", self.top_k, k)
        if sampling.greedy:
            return ("greedy",)
        return ("sampled", replace(sampling, seed=None))

    def _draft(self, choice: tuple, out: Sequence[mx.array]) -> Draft:
        """The whole block's draft: a chain of B - 1 tokens, or the tree of `choice`."""
        if choice[0] == "tree":
            tokens, parent_index, depth_index, ancestors = out
            _, top_k, k = choice
            depth = min(self.block - 1, k)
            tree = DeviceTree(k + 1, depth, top_k, parent_index, depth_index, ancestors)
            return Draft(tokens, tree)
        logprobs = out[1] if choice[0] == "sampled" else None
        return Draft(out[0], Tree.chain(self.block - 1), logprobs)

    def _cut(self, draft: Draft, k: int) -> Draft:
        """A chain's first k tokens (a tree is of its own size)."""
        if not draft.tree.is_chain:
            return draft
        k = min(k, self.block - 1)
        logprobs = None if draft.logprobs is None else draft.logprobs[:k]
        return Draft(draft.tokens[:k], Tree.chain(k), logprobs)


def features_width(head: DFlashHead) -> int:
    """The width of a context feature row: the concatenated taps `fc` reads."""
    return len(head.config.target_layer_ids) * head.args.hidden_size


def _block_fn(head: DFlashHead, target: CausalLM, span: int, choice: tuple) -> Callable:
    """The block's graph: (rows (P, F), fed, committed, pending (1,), *cache) -> the draft's
    arrays, then the cache's."""

    def fn(rows, fed, committed, pending, *arrays):
        cache = KVCache(len(head.layers))
        cache.adopt(arrays)
        seq_len = None
        if head.rope.depends_on_length:  # untraced: the host may read the position
            seq_len = int(committed.item()) + head.config.block_size
        dtype = arrays[0].dtype
        head.write_context(head.context(rows[None].astype(dtype)), cache, fed, seq_len)
        out = _block(head, target, cache, committed, pending, span, choice)
        return (*out, *cache.state)

    return fn


def _block(
    head: DFlashHead,
    target: CausalLM,
    cache: KVCache,
    committed: mx.array,
    pending: mx.array,
    span: int,
    choice: tuple,
) -> tuple[mx.array, ...]:
    """The draft's arrays of the block [pending (1,), mask, ..., mask] at positions
    `committed` (int32) on, over the context rows the cache holds below it."""
    block = head.config.block_size
    mask = mx.ones((block, block), dtype=mx.bool_)  # every block row sees the whole block
    cache.start, cache.attended = committed, span
    tokens = mx.concatenate(
        [pending.astype(mx.int32), mx.full((block - 1,), head.config.mask_token_id, mx.int32)]
    )
    embeds = target.model.embed_tokens(tokens)[None]  # (1, B, h)
    ctx = build_context(
        head.rope, cache, block, None, mask, head.window, head.sliding, embeds.dtype
    )
    out = head(embeds, ctx)[0, 1:]  # (B - 1, h): the drafts' rows
    logits = target.project(out).astype(mx.float32)  # (B - 1, V)
    return _pick(logits, choice)


def _pick(logits: mx.array, choice: tuple) -> tuple[mx.array, ...]:
    """The draft's arrays from the block's (B - 1, V) logits."""
    if choice[0] == "greedy":
        return (mx.argmax(logits, axis=-1).astype(mx.int32),)
    if choice[0] == "sampled":
        rows = log_probs(logits, choice[1])  # (B - 1, V) processed, as the target's are
        return sample(rows), rows
    _, top_k, k = choice
    return _tree(logits, top_k, k)


def _tree(logits: mx.array, top_k: int, k: int) -> tuple[mx.array, ...]:
    """The best k nodes of the product tree of the positions' top_k tokens, by a beam of
    top_k nodes a level: (tokens (k,), parent_index, depth_index, ancestors)."""
    depth = min(logits.shape[0], k)
    scored = logits[:depth] - mx.logsumexp(logits[:depth], axis=-1, keepdims=True)
    ids = mx.argpartition(-scored, kth=top_k - 1, axis=-1)[:, :top_k]  # (D, top_k)
    scores = mx.take_along_axis(scored, ids, axis=-1)
    order = mx.argsort(-scores, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)  # best first
    scores = mx.take_along_axis(scores, order, axis=-1)
    candidates = [(ids[0], scores[0], mx.zeros((top_k,), mx.int32))]  # the root's children
    frontier, frontier_scores = mx.arange(top_k, dtype=mx.int32), scores[0]
    first = top_k  # index of the next level's first candidate
    for level in range(1, depth):
        cumulative = (frontier_scores[:, None] + scores[level][None, :]).reshape(-1)
        parents = mx.repeat(frontier + 1, top_k)  # node ids: candidate index + 1
        candidates.append((mx.tile(ids[level], top_k), cumulative, parents))
        chosen = mx.argsort(-cumulative)[:top_k].astype(mx.int32)
        frontier, frontier_scores = first + chosen, cumulative[chosen]
        first += top_k * top_k
    tokens, cumulative, parents = (mx.concatenate(c) for c in zip(*candidates, strict=True))
    levels = [mx.full((top_k,), 1, mx.int32)]
    levels += [mx.full((top_k * top_k,), d + 2, mx.int32) for d in range(depth - 1)]
    tree, index = select(cumulative, parents, mx.concatenate(levels), k, depth, top_k)
    return tokens[index], tree.parent_index, tree.depth_index, tree.ancestors
