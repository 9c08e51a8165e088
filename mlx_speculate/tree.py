"""Draft trees: chains, static trees (Medusa's) and EAGLE-2 dynamic trees, as one type.

Node 0 is the root: the pending token, the last one emitted and not yet in the target cache.
Every parent precedes its children (the constructors here produce breadth-first order), so a
verify forward feeds the nodes in this order, with `attention_mask` and `positions` telling each
node which tokens it sees. A chain is the tree whose node i has parent i - 1; a root-only tree is
a plain decoding step.

The tree's shape lives on the host; the acceptance rules read it as the constant MLX arrays
below (`parent_index`, `depth_index`, `ancestors`), built once per tree. A compiled step pads a
tree to a row bucket (`padded`): the padding nodes hang off the root (a chain's continue it),
see only their ancestors, and carry the draft token -1, which no rule accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache

import mlx.core as mx
import numpy as np

from .models.context import additive_mask


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]  # parents[0] == -1, parents[i] < i

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if not self.parents or self.parents[0] != -1:
            raise ValueError(f"a tree needs a root: parents[0] must be -1, got {self.parents[:1]}")
        for i, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must come before children")

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
    def depth(self) -> int:
        """The deepest level: at most `depth` drafts can be accepted in one step."""
        return max(self.depths)

    @cached_property
    def is_chain(self) -> bool:
        """Node i's parent is i - 1: the verify forward can use the plain causal mask."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, i: int) -> tuple[int, ...]:
        return self._children[i]

    def path(self, node: int) -> tuple[int, ...]:
        """Node indices from the root to `node`."""
        path = [node]
        while self.parents[path[-1]] != -1:
            path.append(self.parents[path[-1]])
        return tuple(reversed(path))

    def paths(self) -> list[tuple[int, ...]]:
        """Root-to-leaf node-index paths, leaves in node order."""
        return [self.path(i) for i in range(self.num_nodes) if not self._children[i]]

    @cached_property
    def visibility(self) -> np.ndarray:
        """(N, N) bool: [i, j] is True when node j is node i or one of its ancestors."""
        seen = np.eye(self.num_nodes, dtype=bool)
        for i in range(1, self.num_nodes):
            seen[i] |= seen[self.parents[i]]  # parents come first, so their row is complete
        seen.flags.writeable = False
        return seen

    def attention_mask(self, prefix_len: int, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Additive (N, prefix_len + N) mask: 0 on the committed prefix, ancestors and self."""
        return additive_mask(self.ancestors, dtype, prefix_len)

    def positions(self, prefix_len: int) -> mx.array:
        """(N,) int32 rotary positions: the node's depth after the committed prefix."""
        return self.depth_index + prefix_len

    def prefix(self, n: int) -> Tree:
        """The first n nodes; parents precede children, so this is again a tree."""
        if not 1 <= n <= self.num_nodes:
            raise ValueError(f"prefix length must be in [1, {self.num_nodes}], got {n}")
        return Tree(self.parents[:n])

    def subtree(self, kept: Sequence[int]) -> Tree:
        """The nodes `kept` (ascending, the root and every kept node's parent among them)."""
        new_index = {old: new for new, old in enumerate(kept)}
        if not kept or kept[0] != 0:
            raise ValueError("a subtree keeps the root")
        missing = [i for i in kept[1:] if self.parents[i] not in new_index]
        if missing:
            raise ValueError(f"node {missing[0]} is kept without its parent")
        return Tree((-1, *(new_index[self.parents[i]] for i in kept[1:])))

    # -- constant arrays for the acceptance rules ------------------------------------------------

    @cached_property
    def parent_index(self) -> mx.array:
        """(N,) int32 parents, the root pointing at itself (a safe gather index)."""
        return mx.array((0, *self.parents[1:]), dtype=mx.int32)

    @cached_property
    def depth_index(self) -> mx.array:
        """(N,) int32 depths."""
        return mx.array(self.depths, dtype=mx.int32)

    @cached_property
    def ancestors(self) -> mx.array:
        """(N, N) bool `visibility`."""
        return mx.array(self.visibility)

    @cached_property
    def width(self) -> int:
        """The most children of one node (at least 1)."""
        return max(1, max(len(c) for c in self._children))

    def padded(self, rows: int) -> PaddedTree:
        """This tree's arrays for a forward of `rows` >= num_nodes rows."""
        return _padded(self, rows)

    # -- constructors ----------------------------------------------------------------------------

    @classmethod
    def chain(cls, k: int) -> Tree:
        """The root followed by k nodes in a line (draft-model and lookup speculation)."""
        if k < 0:
            raise ValueError(f"chain length must be >= 0, got {k}")
        return _chain(k)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> Tree:
        """A tree from the paths that name its nodes, e.g. [(0,), (1,), (0, 0)] (Medusa's
        "choices": a node is the path of child ranks leading to it from the root).

        Node i + 1 is the i-th path in (length, lexicographic) order, which is breadth-first.
        """
        ordered = sorted((tuple(int(c) for c in path) for path in paths), key=lambda p: (len(p), p))
        index = {(): 0}
        parents = [-1]
        for path in ordered:
            if not path or min(path) < 0:
                raise ValueError(f"path {list(path)} must be non-empty with entries >= 0")
            if path in index:
                raise ValueError(f"path {list(path)} appears twice")
            if path[:-1] not in index:
                raise ValueError(f"path {list(path)} has no parent {list(path[:-1])} in the list")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
        return cls(tuple(parents))

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
        return candidates.subtree(kept), kept

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        children: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, self.num_nodes):
            children[self.parents[i]].append(i)
        return tuple(tuple(c) for c in children)


@dataclass(frozen=True, eq=False)
class PaddedTree:
    """A tree's rule arrays padded to `num_nodes` rows (the acceptance rules take it as they
    take a Tree): padding nodes are never accepted, since their draft tokens are -1."""

    num_nodes: int  # rows, padding included
    depth: int  # the real tree's depth: the rules' static number of levels
    width: int  # the most children of a real node
    is_chain: bool  # the real tree is a chain, continued by the padding
    parent_index: mx.array  # (N,) int32
    depth_index: mx.array  # (N,) int32
    ancestors: mx.array  # (N, N) bool


@dataclass(frozen=True, eq=False)
class DeviceTree:
    """A tree chosen on the device (EAGLE-2 selection): lazy arrays, static size and bounds, so
    that no read-back stands between drafting and the verify forward. The acceptance rules
    and `padded` take it as they take a Tree; `host()` reads it back (one sync), for the rare
    step that must cut it (`Draft.limited`) and for inspection."""

    num_nodes: int
    depth: int  # a bound: no node is deeper
    width: int  # a bound on the children of a node
    parent_index: mx.array  # (N,) int32, the root pointing at itself
    depth_index: mx.array  # (N,) int32
    ancestors: mx.array  # (N, N) bool

    is_chain = False

    def padded(self, rows: int) -> PaddedTree:
        """The arrays padded on the device: padding nodes hang off the root."""
        n = self.num_nodes
        if rows < n:
            raise ValueError(f"cannot pad a tree of {n} nodes to {rows} rows")
        pad = rows - n
        padding = mx.arange(rows) >= n
        seen = mx.pad(self.ancestors, [(0, pad), (0, pad)]) | mx.eye(rows, dtype=mx.bool_)
        seen = seen | (padding[:, None] & (mx.arange(rows) == 0)[None, :])
        return PaddedTree(
            rows,
            self.depth,
            self.width,
            False,
            mx.concatenate([self.parent_index, mx.zeros((pad,), mx.int32)]),
            mx.concatenate([self.depth_index, mx.ones((pad,), mx.int32)]),
            seen,
        )

    def host(self) -> Tree:
        return Tree((-1, *self.parent_index[1:].tolist()))

    @property
    def depths(self) -> tuple[int, ...]:
        return self.host().depths

    def subtree(self, kept: Sequence[int]) -> Tree:
        return self.host().subtree(kept)


@lru_cache(maxsize=256)  # dynamic trees differ every step
def _padded(tree: Tree, rows: int) -> PaddedTree:
    n = tree.num_nodes
    if rows < n:
        raise ValueError(f"cannot pad a tree of {n} nodes to {rows} rows")
    extra = range(n, rows)
    if tree.is_chain:
        parents = [0, *range(rows - 1)]
        depths = list(range(rows))
    else:
        parents = [0, *tree.parents[1:], *(0 for _ in extra)]
        depths = [*tree.depths, *(1 for _ in extra)]
    seen = np.eye(rows, dtype=bool)
    for i in range(1, rows):
        seen[i] |= seen[parents[i]]
    return PaddedTree(
        rows,
        tree.depth,
        tree.width,
        tree.is_chain,
        mx.array(parents, dtype=mx.int32),
        mx.array(depths, dtype=mx.int32),
        mx.array(seen),
    )


@cache
def _chain(k: int) -> Tree:
    # Shared instances, so that their constant arrays are built once.
    return Tree(tuple(range(-1, k)))


ROOT = Tree.chain(0)  # a plain decoding step: the pending token alone
