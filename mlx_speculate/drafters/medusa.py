"""Medusa: heads on the target's last hidden state propose a static tree of top-k candidates.

Node i of the tree sits at depth d and was picked at top-k rank c: its token is head d-1's
(c+1)-th most likely token. The candidates are deterministic given the context, so the tree
rejection rule accepts a child x with probability p(x) and removes it from p before trying the
next sibling, which keeps sampling lossless.

The drafter holds no cache: everything it needs is the final hidden state at the last
committed position (whose lm_head output chose the pending token). Proposals stay lazy until
the loop's one sync.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..graphs import compiled
from ..heads.medusa import DEFAULT_TREE, MEDUSA_TREES, MedusaHeads, load_medusa_heads, medusa_tree
from ..memo import from_folder
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..tree import Tree
from .base import Draft, Drafter, DrafterSpec, TargetFeatures

TreeChoices = str | Sequence[Sequence[int]]


@dataclass(frozen=True, kw_only=True, eq=False)
class MedusaSpec(DrafterSpec):
    """Medusa heads drafting a tree. `heads`: True for those beside the loaded model (`medusa/`
    in its folder), a heads folder or hub id (MLX or published Medusa-1), or `MedusaHeads`.
    `tree` (keyword `medusa_tree=`): a name in MEDUSA_TREES or a list of choices (default
    mc_sim_7b_63); the policy picks how many of its nodes to verify, in the published order.
    The only method that takes `typical_acceptance` (LOSSY, opt-in)."""

    keywords: ClassVar[dict[str, str | None]] = {
        "medusa": "heads",
        "medusa_tree": "tree",
        "tree": "tree",  # the keyword before eagle_tree= existed: checked to be Medusa's
        "typical_acceptance": "typical_acceptance",
    }
    flags: ClassVar[dict[str, str]] = {
        "medusa": "--medusa",
        "medusa_tree": "--medusa-tree",
        "typical_acceptance": "--typical-acceptance",
    }

    heads: bool | str | Path | MedusaHeads = True
    tree: TreeChoices | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        tree = self.tree
        if isinstance(tree, str):
            if tree not in MEDUSA_TREES:
                raise ValueError(
                    f"medusa_tree {tree!r} is unknown (known: {', '.join(MEDUSA_TREES)})"
                )
        elif tree is not None and not _is_choices(tree):
            raise TypeError(
                f"medusa_tree must be a Medusa tree name ({', '.join(MEDUSA_TREES)}) or a list "
                f"of paths, got {type(tree).__name__} (an EagleGrowth goes with eagle=)"
            )

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--medusa",
            nargs="?",
            const=True,
            default=False,
            metavar="DIR",
            help="draft trees with Medusa heads: those beside the model (its medusa/ folder), "
            "or the heads folder DIR",
        )
        group.add_argument(
            "--medusa-tree",
            choices=list(MEDUSA_TREES),
            default=None,
            help=f"Medusa tree (default: {DEFAULT_TREE})",
        )
        group.add_argument(
            "--typical-acceptance",
            action="store_true",
            help="Medusa's typical acceptance when sampling: faster but LOSSY (the output no "
            "longer follows the model's distribution)",
        )

    @classmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {
            "medusa": args.medusa,
            "medusa_tree": args.medusa_tree,
            "typical_acceptance": args.typical_acceptance,
        }

    def resolve(self, target: CausalLM) -> MedusaSpec:
        heads = self.heads
        if isinstance(heads, MedusaHeads):
            return self
        if heads is True:
            if target.origin.folder is None:
                raise ValueError(
                    "Medusa heads beside the model need a model loaded from a folder; "
                    "name the heads folder instead"
                )
            heads = target.origin.folder
        elif not isinstance(heads, str | Path):
            raise ValueError(f"Medusa heads must be a folder or MedusaHeads, got {heads!r}")
        loaded = from_folder(target, "medusa", heads, lambda: load_medusa_heads(heads, target))
        return replace(self, heads=loaded)

    def build(self, target: CausalLM, tokenizer=None) -> MedusaDrafter:
        heads = self.resolve(target).heads
        heads.check_fits(target)
        drafter = MedusaDrafter(heads, DEFAULT_TREE if self.tree is None else self.tree)
        if self.num_draft_tokens is not None:
            drafter.max_draft = min(drafter.max_draft, self.num_draft_tokens)
        return drafter


def _is_choices(tree: Any) -> bool:
    """Whether `tree` is a list of paths of top-k ranks, e.g. [[0], [1], [0, 0]]."""
    return (
        isinstance(tree, Sequence)
        and all(isinstance(p, Sequence) and not isinstance(p, str) for p in tree)
        and all(isinstance(r, int) and r >= 0 for p in tree for r in p)
    )


class MedusaDrafter(Drafter):
    taps: tuple[int, ...] = ()

    follows_context = False

    def __init__(self, heads: MedusaHeads, tree: TreeChoices = DEFAULT_TREE):
        self.heads = heads
        if isinstance(tree, str):
            if tree not in MEDUSA_TREES:
                raise ValueError(
                    f"Medusa tree {tree!r} is unknown (known: {', '.join(MEDUSA_TREES)})"
                )
            tree = MEDUSA_TREES[tree]
        # Paths the heads cannot fill (too deep, or ranks past the vocabulary) are dropped;
        # their descendants go with them, so what is left is still parent-closed.
        self._choices = tuple(
            tuple(path)
            for path in tree
            if len(path) <= heads.num_heads and max(path) < heads.vocab_size
        )
        self.max_draft = len(self._choices)
        self._plans: dict[int, tuple[Tree, mx.array, int, int]] = {}
        self._hidden: mx.array | None = None  # (hidden,) at the last committed position
        self._length = 0  # committed positions seen

    def weights(self) -> tuple[nn.Module, ...]:
        return (self.heads,)

    def tree(self, k: int) -> Tree:
        """The tree verified when the policy asks for `k` draft tokens."""
        return self._plan(k)[0]

    def _plan(self, k: int) -> tuple[Tree, mx.array, int, int]:
        """(tree, flat index of each node into the (depth, width) top-k table, depth, width)."""
        k = min(k, self.max_draft)
        if k not in self._plans:
            # The published order lists paths by estimated acceptance, parents first: its
            # prefixes are the best trees of each size (Tree.prefix would cut in node order).
            tree, ranks = medusa_tree(self._choices[:k])
            depths = np.array(tree.depths[1:])
            depth, width = tree.depth, max(ranks) + 1
            index = mx.array((depths - 1) * width + np.array(ranks[1:]), dtype=mx.int32)  # (k,)
            self._plans[k] = (tree, index, depth, width)
        return self._plans[k]

    def extend(self, features: TargetFeatures) -> None:
        self._hidden = self.heads.inputs(features.hidden, features.taps)[-1]
        self._length += features.hidden.shape[0]

    def rewind(self, length: int) -> None:
        if length < self._length:
            self._hidden = None  # the last committed state is gone with the rest
            self._length = length

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        """Fixed shapes: one compiled graph per tree size (the heads' input is the last hidden
        state); no host sync."""
        if self._hidden is None or k <= 0 or self.max_draft == 0:
            return None
        tree, index, depth, width = self._plan(k)
        key = ("medusa", self._choices[: tree.num_nodes - 1])
        fn = compiled(self.heads, key, lambda: _ranked_fn(self.heads, index, depth, width))
        return Draft(fn(self._hidden), tree)


def _ranked_fn(heads: MedusaHeads, index: mx.array, depth: int, width: int):
    """The draft tokens (k,) of one tree from a hidden state (hidden,): each node takes its
    head's token of its rank."""

    def ranked_tokens(hidden: mx.array) -> mx.array:
        logits = heads(hidden, depth)  # (depth, V)
        top = mx.argpartition(-logits, kth=width - 1, axis=-1)[:, :width]  # (depth, width)
        order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
        ranked = mx.take_along_axis(top, order, axis=-1)  # (depth, width), best first
        return ranked.reshape(-1)[index].astype(mx.int32)

    return ranked_tokens
