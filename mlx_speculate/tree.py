"""Draft trees: static Medusa trees, EAGLE-2 dynamic trees and plain chains, as one type.

Node 0 is the root (the last committed token). Nodes are ordered so that every parent precedes
its children (the constructors here produce breadth-first order); a verify forward feeds them in
this order, with `attention_mask` and `positions` telling each node which tokens it sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]  # parents[0] == -1, parents[i] < i
    # Medusa trees: the top-k rank each node was picked at (root -1); its depth names the head.
    choice_index: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if not self.parents or self.parents[0] != -1:
            raise ValueError(f"a tree needs a root: parents[0] must be -1, got {self.parents[:1]}")
        for i, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must come before children")
        if self.choice_index is not None and len(self.choice_index) != len(self.parents):
            raise ValueError(
                f"choice_index has {len(self.choice_index)} entries for {len(self.parents)} nodes"
            )

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            depths[i] = depths[self.parents[i]] + 1
        return tuple(depths)

    @property
    def head_depth(self) -> int:
        """Deepest level, i.e. how many Medusa heads (or draft steps) it takes to fill the tree."""
        return max(self.depths)

    def children(self, i: int) -> tuple[int, ...]:
        return self._children[i]

    def paths(self) -> list[tuple[int, ...]]:
        """Root-to-leaf node-index paths, leaves in node order."""
        return [self._path_to(i) for i in range(self.num_nodes) if not self._children[i]]

    @cached_property
    def visibility(self) -> np.ndarray:
        """(N, N) bool: [i, j] is True when node j is node i or one of its ancestors."""
        seen = np.eye(self.num_nodes, dtype=bool)
        for i in range(1, self.num_nodes):
            seen[i] |= seen[self.parents[i]]  # parents come first, so their row is complete
        seen.flags.writeable = False
        return seen

    def attention_mask(self, prefix_len: int, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Additive (N, prefix_len + N) mask: 0 on the committed prefix, ancestors and self.

        Hidden entries get the dtype's most negative finite value rather than -inf, which can
        turn into NaN inside fused attention kernels.
        """
        hidden = mx.finfo(dtype).min
        tree = mx.where(mx.array(self.visibility), 0.0, hidden).astype(dtype)  # (N, N)
        prefix = mx.zeros((self.num_nodes, prefix_len), dtype=dtype)  # (N, prefix_len)
        return mx.concatenate([prefix, tree], axis=1)

    def positions(self, prefix_len: int) -> mx.array:
        """(N,) int32 rotary positions: the node's depth after the committed prefix."""
        return mx.array(self.depths, dtype=mx.int32) + prefix_len

    def prefix(self, n: int) -> Tree:
        """The first n nodes; parents precede children, so this is again a tree."""
        if not 1 <= n <= self.num_nodes:
            raise ValueError(f"prefix length must be in [1, {self.num_nodes}], got {n}")
        choice = None if self.choice_index is None else self.choice_index[:n]
        return Tree(self.parents[:n], choice)

    @classmethod
    def chain(cls, k: int) -> Tree:
        """The root followed by k nodes in a line (plain draft-model speculation)."""
        if k < 0:
            raise ValueError(f"chain length must be >= 0, got {k}")
        return cls(tuple(range(-1, k)))

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> Tree:
        """Medusa tree from paths of top-k ranks, e.g. [(0,), (1,), (0, 0)].

        Node i + 1 is the i-th path in (length, lexicographic) order, which is breadth-first.
        """
        paths = sorted((tuple(int(c) for c in path) for path in choices), key=lambda p: (len(p), p))
        index = {(): 0}
        parents = [-1]
        choice_index = [-1]
        for path in paths:
            if not path or min(path) < 0:
                raise ValueError(f"choice {list(path)} must be a non-empty path of ranks >= 0")
            if path in index:
                raise ValueError(f"choice {list(path)} appears twice")
            if path[:-1] not in index:
                raise ValueError(f"choice {list(path)} has no parent {list(path[:-1])} in the list")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            choice_index.append(path[-1])
        return cls(tuple(parents), tuple(choice_index))

    @classmethod
    def from_scores(
        cls, parents: Sequence[int], scores: Sequence[float] | np.ndarray, total: int
    ) -> tuple[Tree, tuple[int, ...]]:
        """EAGLE-2: keep the root and the `total` best-scoring other nodes of a candidate tree.

        scores are cumulative draft log-probs, so no child outscores its parent; ranking ties by
        node order (parents first) then keeps every kept node's ancestors. Returns the sub-tree
        and the original indices of its nodes, ascending (the root's included).
        """
        candidates = cls(tuple(parents))
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape != (candidates.num_nodes,):
            raise ValueError(f"{candidates.num_nodes} nodes got scores of shape {scores.shape}")
        above = [i for i in range(1, len(parents)) if scores[i] > scores[parents[i]]]
        if above:
            raise ValueError(f"node {above[0]} scores above its parent; scores must be cumulative")
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        ranked = sorted(range(1, candidates.num_nodes), key=lambda i: (-scores[i], i))
        kept = (0, *sorted(ranked[:total]))
        new_index = {old: new for new, old in enumerate(kept)}
        sub_parents = [-1] + [new_index[candidates.parents[old]] for old in kept[1:]]
        return cls(tuple(sub_parents)), kept

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        children: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, self.num_nodes):
            children[self.parents[i]].append(i)
        return tuple(tuple(c) for c in children)

    def _path_to(self, node: int) -> tuple[int, ...]:
        path = [node]
        while self.parents[path[-1]] != -1:
            path.append(self.parents[path[-1]])
        return tuple(reversed(path))


# Medusa's published tree for Vicuna-7B (FasterDecoding/Medusa, medusa/model/medusa_choices.py),
# in its published order: 63 choices, 64 nodes with the root, depth 4.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip

# The published order lists every path after its parent (checked in tests), so each prefix of it
# is again a valid tree; the smaller trees below are such prefixes.
MEDUSA_TREES: dict[str, tuple[tuple[int, ...], ...]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "mc_sim_7b_63_prefix19": MC_SIM_7B_63[:19],  # 20 nodes
    "mc_sim_7b_63_prefix6": MC_SIM_7B_63[:6],  # 7 nodes
}
