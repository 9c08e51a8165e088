
import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.heads.medusa import MC_SIM_7B_63, medusa_tree
from mlx_speculate.sampling import SamplingParams, log_probs, sample
from mlx_speculate.tree import Tree
from mlx_speculate.verify import Acceptance, greedy_accept, rejection_accept, typical_accept

from .markov import chi_square_limit

V = 6
FILTERED = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
PLAIN = SamplingParams(temperature=1.0)
# Target rows whose filters leave -inf entries, and draft rows with mass where the target has none.
P_LOGITS = mx.array(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, -2.0],
        [0.0, 1.5, -1.0, 1.0, 0.3, -0.5],
        [1.0, 0.0, 0.0, 2.0, -1.0, 0.5],
    ]
)  # (3, V)
Q_LOGITS = mx.array(
    [
        [-1.0, 0.0, 1.0, 0.5, 2.0, 1.5],
        [1.0, 0.0, 2.0, -1.0, 0.0, 1.0],
    ]
)  # (2, V)


def chi_square(tokens: np.ndarray, logprobs: mx.array) -> float:
    """Pearson's statistic of the observed tokens against exp(logprobs); zero-mass tokens must
    never appear."""
    probs = np.exp(np.asarray(logprobs, dtype=np.float64))  # (V,)
    counts = np.bincount(tokens, minlength=probs.size)
    assert counts[probs == 0].sum() == 0
    expected = tokens.size * probs[probs > 0]
    return float((((counts[probs > 0] - expected) ** 2) / expected).sum())


def limit(logprobs: mx.array) -> float:
    """The chi-square test's 1e-6 quantile for draws from one row (its live tokens)."""
    return chi_square_limit(int(np.isfinite(np.asarray(logprobs)).sum()) - 1)


def assert_follows(tokens: np.ndarray, logprobs: mx.array) -> None:
    assert tokens.size > 1000
    assert chi_square(tokens, logprobs) < limit(logprobs)


def logits_with_argmax(best: list[int], seed: int) -> mx.array:
    logits = np.random.default_rng(seed).normal(size=(len(best), V)).astype(np.float32)
    logits[np.arange(len(best)), best] = 10.0
    return mx.array(logits)  # (len(best), V)


# Greedy chains.


@pytest.mark.parametrize(
    ("draft", "want_accepted"),
    [([3, 1, 4], 3), ([2, 1, 4], 0), ([3, 1, 5], 2), ([3, 0, 4], 1), ([], 0)],
)
def test_greedy_accept(draft, want_accepted):
    target = [3, 1, 4, 5][: len(draft) + 1]
    chain = Tree.chain(len(draft))
    result = greedy_accept(chain, mx.array(draft, dtype=mx.int32), logits_with_argmax(target, 0))
    mx.eval(result.tokens, result.num_accepted)
    assert result.num_accepted.dtype == mx.int32 and result.num_accepted.ndim == 0
    n = result.num_accepted.item()
    assert n == want_accepted
    emitted = result.tokens.tolist()[: n + 1]
    assert emitted == draft[:n] + [target[n]]


def test_greedy_accept_batched():
    draft = mx.array([[3, 1, 4], [3, 2, 4]])
    logits = mx.stack([logits_with_argmax([3, 1, 4, 5], seed=1)] * 2)  # (2, 4, V)
    result = greedy_accept(Tree.chain(3), draft, logits)
    assert result.num_accepted.tolist() == [3, 1]
    assert result.tokens.tolist() == [[3, 1, 4, 5]] * 2


# Rejection sampling on chains.


def run_chain(p: mx.array, q: mx.array, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n independent speculative steps: drafts drawn from q (k, V), verified against p (k+1, V)."""
    mx.random.seed(seed)
    q_batch = mx.broadcast_to(q, (n, *q.shape))  # (n, k, V)
    draft = sample(q_batch) if q.shape[0] else mx.zeros((n, 0), mx.int32)  # (n, k)
    chain = Tree.chain(q.shape[0])
    result = rejection_accept(chain, draft, mx.broadcast_to(p, (n, *p.shape)), q_batch)
    mx.eval(result.tokens, result.num_accepted)
    return np.asarray(result.tokens), np.asarray(result.num_accepted)


@pytest.mark.parametrize("case", ["filtered", "draft_equals_target", "greedy_draft"])
def test_rejection_accept_follows_target(case):
    p = log_probs(P_LOGITS, FILTERED)  # (3, V)
    q = {
        "filtered": log_probs(Q_LOGITS, PLAIN),
        "draft_equals_target": p[:2],
        "greedy_draft": log_probs(logits_with_argmax([1, 3], seed=0), SamplingParams()),
    }[case]  # (2, V)
    tokens, accepted = run_chain(p, q, n=100_000, seed=1)
    if case == "draft_equals_target":
        assert np.all(accepted == 2)
    assert_follows(tokens[:, 0], p[0])
    assert_follows(tokens[accepted >= 1, 1], p[1])
    assert_follows(tokens[accepted == 2, 2], p[2])


def test_rejection_accept_without_drafts_samples_the_target():
    p = log_probs(P_LOGITS[:1], FILTERED)  # (1, V)
    tokens, accepted = run_chain(p, mx.zeros((0, V)), n=20_000, seed=2)
    assert tokens.shape == (20_000, 1) and np.all(accepted == 0)
    assert_follows(tokens[:, 0], p[0])


def test_rejection_accept_with_greedy_target_is_greedy_accept():
    q = log_probs(Q_LOGITS, PLAIN)
    draft = sample(mx.broadcast_to(q, (200, 2, V)), mx.random.key(3))  # (200, 2)
    p = log_probs(mx.broadcast_to(P_LOGITS, (200, 3, V)), SamplingParams())
    chain = Tree.chain(2)
    sampled = rejection_accept(chain, draft, p, mx.broadcast_to(q, (200, 2, V)))
    greedy = greedy_accept(chain, draft, mx.broadcast_to(P_LOGITS, (200, 3, V)))
    assert sampled.num_accepted.tolist() == greedy.num_accepted.tolist()
    for row, n in enumerate(greedy.num_accepted.tolist()):
        assert sampled.tokens[row, : n + 1].tolist() == greedy.tokens[row, : n + 1].tolist()


def test_rejection_accept_single_step_shapes_and_laziness():
    p = log_probs(P_LOGITS, FILTERED)
    q = log_probs(Q_LOGITS, PLAIN)
    # A host sync inside would fail under mx.compile.
    state = [mx.random.state]
    step = mx.compile(
        lambda d: rejection_accept(Tree.chain(2), d, p, q).tokens, inputs=state, outputs=state
    )
    tokens = step(mx.array([0, 1]))
    assert tokens.shape == (3,) and tokens.dtype == mx.int32


# Trees.

#      0
#    / | \
#   1  2  3
#  / \  \
# 4   5  6
PARENTS = (-1, 0, 0, 0, 1, 1, 2)
TREE = Tree(PARENTS)


def walked(result: Acceptance) -> tuple[tuple[int, ...], int]:
    """(accepted path, the target's token after it) of one unbatched acceptance."""
    n = result.num_accepted.item()
    return tuple(result.path.tolist()[: n + 1]), result.tokens.tolist()[n]


def greedy_walk(tokens, logits):
    return walked(greedy_accept(TREE, mx.array(tokens[1:]), logits))


def test_greedy_tree_accept_hand_built():
    tokens = np.array([5, 1, 2, 3, 4, 5, 0])
    # Row i is the target after node i: 0 -> 1 (node 1), 1 -> 5 (node 5), 5 -> 0 (past the leaf).
    result = greedy_accept(TREE, mx.array(tokens[1:]), logits_with_argmax([1, 5, 0, 0, 0, 0, 0], 6))
    assert walked(result) == ((0, 1, 5), 0) and result.num_accepted.item() == 2
    assert result.tokens.tolist() == [1, 5, 0]  # the accepted drafts, then the target's token
    # Node 2 matches but its child does not: stop at node 2 with the target's token there.
    assert greedy_walk(tokens, logits_with_argmax([2, 0, 3, 0, 0, 0, 0], 6)) == ((0, 2), 3)
    assert greedy_walk(tokens, logits_with_argmax([4, 0, 0, 0, 0, 0, 0], 6)) == ((0,), 4)


def test_greedy_tree_accept_matches_brute_force_on_top_k_trees():
    tree, ranks = medusa_tree(MC_SIM_7B_63)
    rng = np.random.default_rng(7)
    for _ in range(30):
        draft = rng.normal(size=(tree.num_nodes, 12))  # ranks in mc_sim_7b_63 reach 9
        ranked = np.argsort(-draft, axis=-1)  # (N, 12): each node's children are its top-k
        picks = [ranked[p, c] for p, c in zip(tree.parents[1:], ranks[1:], strict=True)]
        tokens = np.array([0, *picks])
        target = draft + rng.normal(scale=0.7, size=draft.shape)  # agrees with the draft often
        best = target.argmax(-1)
        matched = [
            i for i in range(tree.num_nodes)
            if all(tokens[j] == best[tree.parents[j]] for j in path_to(tree, i)[1:])
        ]
        # The documented assumption: top-k siblings are distinct, so at most one child matches.
        for i in range(tree.num_nodes):
            siblings = [tokens[c] for c in tree.children(i)]
            assert len(set(siblings)) == len(siblings)
            assert sum(c in matched for c in tree.children(i)) <= 1
        deepest = max(matched, key=lambda i: tree.depths[i])
        result = greedy_accept(tree, mx.array(tokens[1:]), mx.array(target.astype(np.float32)))
        assert walked(result) == (path_to(tree, deepest), best[deepest])


def path_to(tree: Tree, node: int) -> tuple[int, ...]:
    return next(p[: p.index(node) + 1] for p in tree.paths() if node in p)


def tree_rows(seed: int) -> tuple[mx.array, mx.array]:
    """Target (N, V) rows with -inf entries; draft (N, V) rows also put mass where p has none."""
    rng = np.random.default_rng(seed)
    p_logits = rng.normal(scale=1.5, size=(len(PARENTS), V)).astype(np.float32)
    p = log_probs(mx.array(p_logits), FILTERED)
    q_logits = p_logits + rng.normal(size=p_logits.shape)  # a close draft, but unfiltered
    return p, log_probs(mx.array(q_logits.astype(np.float32)), PLAIN)


def run_tree(p, q, sampled_children: bool, pass_q: bool, n: int, seed: int):
    """First emitted token, and the second one where the path went through node 1."""
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    q_np = np.exp(np.asarray(q, dtype=np.float64))
    q_np /= q_np.sum(-1, keepdims=True)
    tokens = np.zeros((n, len(PARENTS)), dtype=np.int64)
    for i, parent in enumerate(PARENTS[1:], start=1):
        if sampled_children:
            tokens[:, i] = rng.choice(V, size=n, p=q_np[parent])
        else:
            rank = PARENTS[1:i].count(parent)  # i is its parent's rank-th child
            tokens[:, i] = np.argsort(-q_np[parent], kind="stable")[rank]
    rows = (n, *p.shape)  # one independent step per row
    q_arg = mx.broadcast_to(q, rows) if pass_q else None
    result = rejection_accept(TREE, mx.array(tokens[:, 1:]), mx.broadcast_to(p, rows), q_arg)
    emitted, path = np.array(result.tokens), np.array(result.path)
    through = (np.array(result.num_accepted) >= 1) & (path[:, 1] == 1)
    return emitted[:, 0], emitted[through, 1]


@pytest.mark.parametrize("sampled_children", [False, True])
def test_tree_rejection_accept_follows_target(sampled_children):
    p, q = tree_rows(seed=8)
    first, second = run_tree(p, q, sampled_children, pass_q=sampled_children, n=12_000, seed=9)
    assert_follows(first, p[0])
    assert_follows(second, p[1])


def test_tree_rejection_naive_rule_on_top_k_children_is_biased():
    # Deterministic top-k children judged with min(1, p/q) against the real q: not lossless.
    top4 = SamplingParams(temperature=1.0, top_k=4)
    p = log_probs(mx.array([[0.0, 0.0, 0.0, 2.0, -9.0, -9.0]] * len(PARENTS)), top4)
    q = log_probs(mx.array([[2.0, 1.7, 1.4, 0.0, -9.0, -9.0]] * len(PARENTS)), PLAIN)
    naive, _ = run_tree(p, q, sampled_children=False, pass_q=True, n=3_000, seed=10)
    assert chi_square(naive, p[0]) > 10 * limit(p[0])
    right, _ = run_tree(p, q, sampled_children=False, pass_q=False, n=3_000, seed=10)
    assert chi_square(right, p[0]) < limit(p[0])


def test_tree_rejection_accept_with_greedy_target_walks_the_argmax():
    tokens = np.array([5, 1, 2, 3, 4, 5, 0])
    logits = logits_with_argmax([1, 5, 0, 0, 0, 0, 0], 6)
    greedy = log_probs(logits, SamplingParams())
    result = rejection_accept(TREE, mx.array(tokens[1:]), greedy)
    assert walked(result) == greedy_walk(tokens, logits)


# Typical acceptance.


def test_typical_accept_with_point_masses_is_greedy():
    tokens = np.array([5, 1, 2, 3, 4, 5, 0])
    logits = logits_with_argmax([2, 0, 3, 0, 0, 0, 0], 6)
    typical = typical_accept(TREE, mx.array(tokens[1:]), log_probs(logits, SamplingParams()))
    assert walked(typical) == greedy_walk(tokens, logits)


def test_typical_accept_thresholds_and_ties():
    root = np.append(np.log([0.5, 0.3, 0.1, 0.05, 0.05]), -np.inf)  # cutoff 0.3 * exp(-H) ~ 0.087
    flat = np.log(np.full(V, 1 / V))  # cutoff 0.3 / 6 = 0.05: every token passes
    peaked = np.log([0.02, 0.02, 0.02, 0.02, 0.02, 0.9])
    rows = np.stack([root, peaked, peaked, flat, flat, flat, flat]).astype(np.float32)
    # Children of the root hold tokens 0 (p=.5), 1 (p=.3), 3 (p=.05: rejected).
    tokens = np.array([5, 0, 1, 3, 0, 5, 0])
    # Node 1's children: token 0 fails (0.02), token 5 passes; node 2's child (token 0) fails.
    result = typical_accept(TREE, mx.array(tokens[1:]), mx.array(rows))
    assert walked(result) == ((0, 1, 5), 0)
    # With node 5 rejected too, nodes 1 and 2 tie on depth: the likelier token (p=.5) wins.
    result = typical_accept(TREE, mx.array([1, 0, 3, 0, 0, 0]), mx.array(rows))
    assert walked(result) == ((0, 2), 5)


def test_greedy_chain_shortcut_agrees_with_the_tree_walk():
    """A chain takes the leading-run shortcut; the general walk over the same chain plus a
    sibling of node 1 that never matches (so not a chain) accepts the same path and token."""
    rng = np.random.default_rng(3)
    for k in (1, 2, 5):
        chain = Tree.chain(k)
        branched = Tree((*chain.parents, 0))
        for _ in range(20):
            best = rng.integers(0, V, size=k + 2)  # the argmax after each node
            draft = np.where(rng.random(k) < 0.7, best[:k], (best[:k] + 1) % V)
            logits = logits_with_argmax(best.tolist(), seed=int(rng.integers(1 << 30)))
            shortcut = greedy_accept(chain, mx.array(draft), logits[: k + 1])
            sibling = (best[0] + 1) % V  # never the target's first token
            general = greedy_accept(branched, mx.array([*draft.tolist(), int(sibling)]), logits)
            assert walked(shortcut) == walked(general)
