"""Medusa: heads on the target's last hidden state propose a static tree of top-k candidates.

Node i of the tree sits at depth d and was picked at top-k rank c: its token is head d-1's
(c+1)-th most likely token. The candidates are deterministic given the context, so the tree
rejection rule accepts a child x with probability p(x) and removes it from p before trying the
next sibling, which keeps sampling lossless.

The drafter holds no cache: everything it needs is `TargetState.hidden[-1]`, the final hidden
state at the last committed position (whose lm_head output chose the pending token). Proposals
stay lazy until the loop's one sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..heads import MedusaHeads
from ..tree import MEDUSA_TREES, Tree
from . import Draft, TargetState

DEFAULT_TREE = "mc_sim_7b_63"

TreeSpec = str | Sequence[Sequence[int]] | Tree


class MedusaDrafter:
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, heads: MedusaHeads, tree: TreeSpec = DEFAULT_TREE):
        self.heads = heads
        self._choices: tuple[tuple[int, ...], ...] | None = None
        self._tree: Tree | None = None
        if isinstance(tree, Tree):
            if tree.choice_index is None:
                raise ValueError("a Medusa tree needs choice_index (build it with from_choices)")
            if tree.head_depth > heads.num_heads:
                raise ValueError(
                    f"the tree is {tree.head_depth} deep but there are {heads.num_heads} heads"
                )
            self._tree = tree
            self.max_draft = tree.num_nodes - 1
        else:
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

    def tree(self, k: int) -> Tree:
        """The tree verified when the policy asks for `k` draft tokens."""
        return self._plan(k)[0]

    def _plan(self, k: int) -> tuple[Tree, mx.array, int, int]:
        """(tree, flat index of each node into the (depth, width) top-k table, depth, width)."""
        k = min(k, self.max_draft)
        if k not in self._plans:
            if self._choices is not None:
                # The published order lists paths by estimated acceptance, parents first: its
                # prefixes are the best trees of each size (Tree.prefix would cut in BFS order).
                tree = Tree.from_choices(self._choices[:k])
            else:
                tree = self._tree.prefix(k + 1)
            depths = np.array(tree.depths[1:])
            ranks = np.array(tree.choice_index[1:])
            depth, width = int(depths.max()), int(ranks.max()) + 1
            index = mx.array((depths - 1) * width + ranks, dtype=mx.int32)  # (k,)
            self._plans[k] = (tree, index, depth, width)
        return self._plans[k]

    def propose(self, context: Sequence[int], k: int, state: TargetState | None) -> Draft | None:
        if state is None or k <= 0 or self.max_draft == 0:
            return None  # the first step after prefill has no hidden state yet
        tree, index, depth, width = self._plan(k)
        logits = self.heads(state.hidden[-1], depth)  # (depth, V)
        top = mx.argpartition(-logits, kth=width - 1, axis=-1)[:, :width]  # (depth, width)
        order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
        ranked = mx.take_along_axis(top, order, axis=-1)  # (depth, width), best first
        return Draft(ranked.reshape(-1)[index].astype(mx.int32), None, tree)

    def rewind(self, length: int) -> None:
        pass  # no state of its own
