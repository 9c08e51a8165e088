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
from ..step import bucket
from ..tree import DeviceTree, Tree
from .base import Draft, Drafter, DrafterSpec, TargetFeatures
from .eagle_grow import select
from .features import FeatureQueue


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
                raise ValueError("no DFlash drafter beside the model (name the drafter folder)")
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


class DFlashDrafter(Drafter):
    """Drafts blocks below the pending token from the context rows of every committed
    position; its cache holds their keys and values, slot = position."""

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
        mx.eval(head.parameters())

    def weights(self) -> tuple[nn.Module, ...]:
        return (self.head,)

    def extend(self, features_: TargetFeatures) -> None:
        self._features.add(features(features_.taps))

    def rewind(self, length: int) -> None:
        self._features.rewind(length)

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        committed = len(context) - 1
        k = min(k, self.max_draft)
        if k <= 0 or self._features.known != committed:
            return None
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
        choice = self._choice(k, sampling)
        key = ("dflash", id(self.head), padded, span, choice)
        build = lambda: _block_fn(self.head, self.target, span, choice)  # noqa: E731
        fn = compiled(self.head, key, build, traced=self.head.traceable)
        fed = mx.array(self._features.fed, mx.int32)
        pending = mx.array(context[-1:], mx.int32)
        out = fn(rows, fed, mx.array(committed, mx.int32), pending, *self.cache.state)
        layers = len(self.cache.state)
        self.cache.set_arrays(out[len(out) - layers :])
        self.cache.advance(committed - self.cache.offset)
        self._features.mark_fed(committed)
        return self._draft(k, choice, out[: len(out) - layers])

    def _choice(self, k: int, sampling: SamplingParams) -> tuple:
        """What shapes the block's graph besides its sizes: ("greedy",), ("sampled",
        settings) or ("tree", top_k, k)."""
        if self.top_k > 1:
            return ("tree", self.top_k, k)
        if sampling.greedy:
            return ("greedy",)
        return ("sampled", replace(sampling, seed=None))

    def _draft(self, k: int, choice: tuple, out: Sequence[mx.array]) -> Draft:
        if choice[0] == "tree":
            tokens, parent_index, depth_index, ancestors = out
            depth = min(self.block - 1, k)
            tree = DeviceTree(k + 1, depth, self.top_k, parent_index, depth_index, ancestors)
            return Draft(tokens, tree)
        k = min(k, self.block - 1)
        tokens = out[0][:k]
        logprobs = out[1][:k] if choice[0] == "sampled" else None
        return Draft(tokens, Tree.chain(k), logprobs)


def features_width(head: DFlashHead) -> int:
    """The width of a context feature row: the concatenated taps `fc` reads."""
    return len(head.config.target_layer_ids) * head.args.hidden_size


def _block_fn(head: DFlashHead, target: CausalLM, span: int, choice: tuple) -> Callable:
    """The block's graph: (rows (P, F), fed, committed, pending (1,), *cache) -> the draft's
    arrays, then the cache's."""
    config = head.config
    block = config.block_size
    mask = mx.ones((block, block), dtype=mx.bool_)  # every block row sees the whole block

    def fn(rows, fed, committed, pending, *arrays):
        cache = KVCache(len(head.layers))
        cache.adopt(arrays)
        seq_len = None
        if head.rope.depends_on_length:  # untraced: the host may read the position
            seq_len = int(committed.item()) + block
        dtype = arrays[0].dtype
        head.write_context(head.context(rows[None].astype(dtype)), cache, fed, seq_len)
        cache.start, cache.attended = committed, span
        tokens = mx.concatenate([pending, mx.full((block - 1,), config.mask_token_id, mx.int32)])
        embeds = target.model.embed_tokens(tokens)[None]  # (1, B, h)
        ctx = build_context(
            head.rope, cache, block, None, mask, head.window, head.sliding, embeds.dtype
        )
        out = head(embeds, ctx)[0, 1:]  # (B - 1, h): the drafts' rows
        logits = target.project(out).astype(mx.float32)  # (B - 1, V)
        return (*_pick(logits, choice), *cache.state)

    return fn


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
