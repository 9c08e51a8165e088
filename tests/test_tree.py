import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.heads.medusa import MC_SIM_7B_63, MEDUSA_TREES, medusa_tree
from mlx_speculate.tree import Tree

#      0
#    / | \
#   1  2  3
#  / \  \
# 4   5  6
HAND = Tree((-1, 0, 0, 0, 1, 1, 2))


def ancestors_or_self(tree: Tree, node: int) -> set[int]:
    seen = {node}
    while tree.parents[node] != -1:
        node = tree.parents[node]
        seen.add(node)
    return seen


def test_chain_mask_and_positions():
    tree = Tree.chain(3)
    assert tree.parents == (-1, 0, 1, 2) and tree.num_nodes == 4 and tree.depth == 3
    mask = np.asarray(tree.attention_mask(prefix_len=2))  # (4, 6)
    assert mask.shape == (4, 6)
    visible = mask == 0
    np.testing.assert_array_equal(visible[:, :2], True)
    np.testing.assert_array_equal(visible[:, 2:], np.tril(np.ones((4, 4), dtype=bool)))
    assert tree.positions(2).tolist() == [2, 3, 4, 5]
    assert tree.positions(2).dtype == mx.int32
    assert Tree.chain(0).parents == (-1,)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mask_visibility_is_the_ancestor_relation(dtype):
    tree = Tree.from_paths(MC_SIM_7B_63)
    mask = tree.attention_mask(prefix_len=5, dtype=dtype)
    assert mask.dtype == dtype and mask.shape == (64, 69)
    mask = np.asarray(mask.astype(mx.float32))
    assert np.all(np.isfinite(mask)) and mask.min() < -1e4
    for i in range(tree.num_nodes):
        seen = {j for j in range(tree.num_nodes) if mask[i, 5 + j] == 0}
        assert seen == ancestors_or_self(tree, i)
    assert np.all(mask[:, :5] == 0)
    depths = [len(ancestors_or_self(tree, i)) - 1 for i in range(tree.num_nodes)]
    assert tree.positions(5).tolist() == [5 + d for d in depths]


def test_paths_children_depths():
    assert HAND.paths() == [(0, 3), (0, 1, 4), (0, 1, 5), (0, 2, 6)]  # leaves in node order
    assert HAND.children(0) == (1, 2, 3) and HAND.children(1) == (4, 5) and HAND.children(6) == ()
    assert HAND.depths == (0, 1, 1, 1, 2, 2, 2) and HAND.depth == 2
    assert HAND.positions(10).tolist() == [10, 11, 11, 11, 12, 12, 12]
    assert HAND.prefix(4) == Tree((-1, 0, 0, 0))
    assert HAND.prefix(4).paths() == [(0, 1), (0, 2), (0, 3)]


@pytest.mark.parametrize("parents", [(), (0,), (-1, 1), (-1, 0, 3, 1), (-1, -1)])
def test_invalid_parents_raise(parents):
    with pytest.raises(ValueError, match="parent"):
        Tree(parents)


def test_from_paths_small():
    tree, ranks = medusa_tree([(1,), (0,), (0, 0), (1, 0), (0, 1)])
    # Sorted by (length, path): (0,) (1,) (0, 0) (0, 1) (1, 0).
    assert tree.parents == (-1, 0, 0, 1, 1, 2)
    assert ranks == (-1, 0, 1, 0, 1, 0)
    assert tree.depth == 2
    assert tree.prefix(3) == Tree((-1, 0, 0))


@pytest.mark.parametrize(
    ("choices", "message"),
    [([(0,), (0, 0), (0,)], "twice"), ([(0,), (1, 0)], "no parent"), ([(0,), ()], "non-empty")],
)
def test_from_paths_rejects_bad_lists(choices, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_paths(choices)


def test_mc_sim_7b_63():
    assert len(MC_SIM_7B_63) == 63 and len(set(MC_SIM_7B_63)) == 63
    tree = Tree.from_paths(MC_SIM_7B_63)
    assert tree.num_nodes == 64 and tree.depth == 4
    assert max(max(path) for path in MC_SIM_7B_63) == 9  # top-10 per head
    # Breadth-first with siblings in rank order: depth and parent never decrease.
    assert list(tree.depths) == sorted(tree.depths)
    assert list(tree.parents[1:]) == sorted(tree.parents[1:])
    # Every prefix of the published order lists each path's parent first, so it is a tree.
    for n in range(1, 64):
        assert MC_SIM_7B_63[n - 1][:-1] in {(), *MC_SIM_7B_63[: n - 1]}
    sizes = {name: Tree.from_paths(choices).num_nodes for name, choices in MEDUSA_TREES.items()}
    assert sizes == {"mc_sim_7b_63": 64, "mc_sim_7b_63_prefix19": 20, "mc_sim_7b_63_prefix6": 7}


def eagle_candidates(rng: np.random.Generator, top_k: int, depth: int):
    """A candidate tree as EAGLE-2 expands it: top_k children for each of the top_k best frontier
    nodes, level by level, scored by cumulative log-prob."""
    parents, scores, frontier = [-1], [0.0], [0]
    for _ in range(depth):
        grown = []
        for node in frontier:
            logp = np.log(rng.dirichlet(np.ones(8)))[:top_k]
            for lp in logp:
                parents.append(node)
                scores.append(scores[node] + lp)
                grown.append(len(parents) - 1)
        frontier = sorted(grown, key=lambda i: -scores[i])[:top_k]
    return parents, np.array(scores)


def test_from_scores_keeps_ancestors_and_the_best_nodes():
    rng = np.random.default_rng(0)
    for total in [0, 1, 7, 20, 60]:
        parents, scores = eagle_candidates(rng, top_k=4, depth=5)
        tree, kept = Tree.from_scores(parents, scores, total)
        assert kept[0] == 0 and list(kept) == sorted(kept) and tree.num_nodes == total + 1
        assert all(parents[old] in kept for old in kept[1:])
        for new, old in enumerate(kept[1:], start=1):
            assert kept[tree.parents[new]] == parents[old]
        dropped = [i for i in range(1, len(parents)) if i not in kept]
        if total:
            assert min(scores[list(kept[1:])]) >= max(scores[dropped])


def test_from_scores_ties_keep_the_parent():
    # Node 2 is certain given node 1 (log-prob 0), so it ties with its parent.
    parents = [-1, 0, 1, 0]
    tree, kept = Tree.from_scores(parents, [0.0, -0.5, -0.5, -0.7], total=1)
    assert kept == (0, 1) and tree.parents == (-1, 0)
    with pytest.raises(ValueError, match="above its parent"):
        Tree.from_scores(parents, [0.0, -0.5, -0.2, -0.7], total=2)
