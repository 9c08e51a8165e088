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
import mlx.nn as nn

from ..cli import bounded, non_negative_int, positive_int
from ..graphs import compiled
from ..heads.eagle import EagleHead
from ..heads.eagle_format import EAGLE_DIR, load_eagle_heads
from ..heads.linear import store_transposed
from ..memo import from_folder
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..step import Then, bucket, cache_view
from ..tree import DeviceTree, Tree
from .base import Draft, DrafterSpec, FusedDrafter, TargetFeatures
from .eagle_grow import catch_up_and_grow, grow
from .features import FeatureQueue, FusedSteps


@dataclass(frozen=True)
class EagleGrowth:
    """How EAGLE-2 grows its draft trees (the official defaults): nodes verified with the root,
    levels expanded, and children per node; `top_k` 1 makes a chain."""

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
    def chain(cls, k: int) -> EagleGrowth:
        """A chain of k drafts."""
        return cls(total=k + 1, depth=k - 1, top_k=1)


@dataclass(frozen=True, kw_only=True, eq=False)
class EagleSpec(DrafterSpec):
    """EAGLE heads drafting dynamic trees. `heads`: True for those beside the loaded model
    (`eagle/` in its folder), a heads folder, file or hub id in any published layout (SafeAILab
    EAGLE-1 or EAGLE-3, SpecForge, AngelSlim, speculators, or MLX), or an `EagleHead`.
    `tree` (keyword `eagle_tree=`): an `EagleGrowth`."""

    keywords: ClassVar[dict[str, str | None]] = {
        "eagle": "heads",
        "eagle_tree": "tree",
        "tree": "tree",  # the keyword before eagle_tree= existed: checked to be an EagleGrowth
    }
    flags: ClassVar[dict[str, str]] = {
        "eagle": "--eagle",
        "eagle_tree": "--tree-total/--tree-depth/--tree-top-k",
    }

    heads: bool | str | Path | EagleHead = True
    tree: EagleGrowth = EagleGrowth()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.tree, EagleGrowth):
            raise TypeError(
                f"eagle_tree must be an EagleGrowth (e.g. EagleGrowth(total=30)), got "
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
        default = EagleGrowth()
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
        return {"eagle": args.eagle, "eagle_tree": EagleGrowth(**shape) if shape else None}

    def resolve(self, target: CausalLM) -> EagleSpec:
        heads = self.heads
        if isinstance(heads, EagleHead):
            return self
        if heads is True:
            if target.origin.folder is None or not (target.origin.folder / EAGLE_DIR).is_dir():
                raise ValueError(
                    "no EAGLE heads beside the model: name the heads folder, convert published "
                    "heads with `convert --eagle-path`, or train them with `python -m "
                    "mlx_speculate.train eagle3 --model M --out DIR`"
                )
            heads = target.origin.folder / EAGLE_DIR
        if not isinstance(heads, str | Path):
            raise ValueError(f"EAGLE heads must be a folder or an EagleHead, got {heads!r}")
        loaded = from_folder(target, "eagle", heads, lambda: load_eagle_heads(heads, target))
        return replace(self, heads=loaded)

    def build(self, target: CausalLM, tokenizer=None) -> EagleDrafter:
        heads = self.resolve(target).heads
        drafter = EagleDrafter(heads, target, heads.check_fits(target), self.tree)
        if self.num_draft_tokens is not None:
            drafter.max_draft = min(drafter.max_draft, self.num_draft_tokens)
        return drafter


class EagleDrafter(FusedDrafter):
    """Grows EAGLE-2 trees (or chains) from the head's state at the last committed position.

    A step can be fused (`then`): the verify step's graph runs the head over the accepted
    path and grows the next tree from its end (eagle_grow.catch_up_and_grow), so a step is
    one compiled call and one host sync; `settle` then takes the accepted count, and the
    next `propose` of the same size returns that tree. The next fused step can also be
    queued before that count is read (`follow`): its tree and the slot its path starts at
    are lazy in it. Otherwise (the first step, a plain step between, another size)
    `propose` runs the head over the positions it has not seen, then grows the tree in a
    compiled graph of its own."""

    follows_context = False

    def __init__(self, head: EagleHead, target: CausalLM, taps: tuple[int, ...], tree: EagleGrowth):
        self.head = head
        self.target = target
        self.taps = taps
        self.settings = tree
        self.max_draft = tree.total - 1
        self.cache = head.make_cache()
        self._features = FeatureQueue(self.cache)  # rows: the head's inputs from the target
        self._last: mx.array | None = None  # (h,) the head's output at position fed - 1
        self._k = 0  # the size of the last proposal
        self._fused = FusedSteps(self._features)  # entries: (the head's last output, tree)
        store_transposed(head)  # one-row products multiply the weights untransposed
        mx.eval(head.parameters())  # traced graphs capture them as they are

    def weights(self) -> tuple[nn.Module, ...]:
        return (self.head,)

    def extend(self, features: TargetFeatures) -> None:
        self._features.add(self.head.inputs(features.hidden, features.taps))

    def rewind(self, length: int) -> None:
        if self._fused.rewind(length):
            self._last = None

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        committed = len(context) - 1
        k = min(k, self.max_draft)
        ready = self._fused.take_ready()
        if k <= 0 or self._features.known != committed:
            return None
        if ready is not None and k == self._k and not self._features.waiting:
            return ready[1]
        fed = self._features.fed
        self.cache.truncate(fed)  # the last proposal's tree slots
        features = self._features.rows()  # (m, F)
        if features is not None:
            tokens = mx.array(context[fed + 1 : committed + 1], dtype=mx.int32)  # (m,)
            out = self.head(
                self._embed(tokens)[None], features[None], self.cache, from_target=True
            )[0]
            self._last = out[-1]
            self._features.mark_fed(committed)
        if self._last is None:
            return None
        self._k = k
        return self._grow(k)

    def then(self) -> Then | None:
        """The next proposal, of the last one's size, traced into the verify step of the
        last one (or, after `follow`, of the step queued on its count); None when the head
        cannot be traced. Fixed shapes: the accepted path's rows (the verified tree's depth
        bound + 1), and the tree as `_grow` makes it; the path's first slot is an input."""
        start = self._fused.path_start()
        if not self.head.traceable or self._features.waiting or start is None:
            return None
        if self._last is None and not self._fused.queued:  # no proposal since a rewind
            return None
        head, embed, project, k = self.head, self._embed, self._project, self._k
        top_k, depth = self._shape(k)
        end = start[1] + bucket(k + 1) + depth * top_k  # the path has at most bucket rows
        self.cache.reserve(end)
        span = self.cache.span(end)

        def trace(acceptance, hidden, taps, fed, *arrays):
            view = cache_view(head, arrays, fed, span)
            out = catch_up_and_grow(
                head, embed, project, acceptance, hidden, taps, view, fed, top_k, depth, k
            )
            return (*out, *view.state)

        key = ("eagle", id(head), top_k, depth, k, span)  # a part of the step's graph's key
        return Then(key, (start[0], *self.cache.state), trace)

    def received(self, outputs: Sequence[mx.array]) -> None:
        """The fused step's lazy outputs (`Verified.then`)."""
        last, *tree = self.cache.take_outputs(outputs)
        self._fused.received(last, self._draft(*tree))

    def follow(
        self,
        drafted: mx.array,
        accepted: mx.array,
        pending: mx.array,
        k: int,
        sampling: SamplingParams,
    ) -> Draft | None:
        """The tree the fused step being verified grew, for the step queued on the count of
        drafts it `accepted` (an int32 scalar) before that count is read: the next `then`
        runs the head over a path from the slot after them. None unless exactly that step
        is unsettled and the next is fused and of its size."""
        sole = self._fused.sole()
        if min(k, self.max_draft) != self._k or sole is None or not self.head.traceable:
            return None
        self._fused.follow(accepted, self._k)
        return sole[1]

    def settle(self, accepted: int) -> None:
        """The oldest fused step accepted `accepted` drafts: the head has run over those
        positions and the root's, and its draft follows them (unless a step queued on this
        one's count took it already)."""
        self._last, _ = self._fused.settle(accepted)

    def _shape(self, k: int) -> tuple[int, int]:
        """(top-k, levels) of a proposal of k nodes: deeper levels could not be among k."""
        return min(self.settings.top_k, k), min(self.settings.depth, k - 1)

    def _grow(self, k: int) -> Draft:
        """The best k nodes of an EAGLE-2 tree below the pending token.

        Fixed shapes: the levels and the selection are one compiled graph per (top-k, depth,
        k, span) whose inputs are the head's state at the last committed position, the first
        tree slot (an array) and the head's cache, read over its leading span; each level's
        mask is a bool visibility over the tree's own slots. No host sync."""
        top_k, depth = self._shape(k)
        end = self._features.fed + depth * top_k
        self.cache.reserve(end)
        span = self.cache.span(end)
        key = ("eagle", id(self.target), top_k, depth, k)
        head, embed, project = self.head, self._embed, self._project

        def build() -> Callable:
            def fn(last, start, *arrays):
                view = cache_view(head, arrays, start, span)
                out = grow(head, embed, project, last, view, start, top_k, depth, k)
                return (*out, *view.state)

            return fn

        fn = compiled(self.head, key, build, traced=self.head.traceable, span=span)
        out = fn(self._last, mx.array(self._features.fed, mx.int32), *self.cache.state)
        drafted = self.cache.take_outputs(out)
        self.cache.advance(depth * top_k)
        return self._draft(*drafted)

    def _draft(self, tokens: mx.array, *tree: mx.array) -> Draft:
        if not tree:  # a chain: its first k nodes are its best ones
            return Draft(tokens, Tree.chain(tokens.shape[0]))
        top_k, depth = self._shape(self._k)
        return Draft(tokens, DeviceTree(self._k + 1, depth + 1, top_k, *tree))

    def _embed(self, tokens: mx.array) -> mx.array:
        return self.target.model.embed_tokens(tokens)

    def _project(self, out: mx.array) -> mx.array:
        return self.head.logits(out, self.target)
