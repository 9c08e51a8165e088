"""One target forward over a draft tree (Tree.attention_mask / Tree.positions) equals sequential
forwards along every root-to-leaf path, and compacting an accepted path leaves the cache as a
fresh forward over that path would."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.heads.medusa import MEDUSA_TREES
from mlx_speculate.loading import load_model
from mlx_speculate.tree import Tree

from .helpers import MODELS, assert_float32_close, tiny_model

# Depth 4, branching up to 3 at the root and 2 below.
CHOICES = [
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1), (0, 0, 0, 0),
]  # fmt: skip
# Gemma 2 and 3, Mistral and Ministral 3: window 6 < prefix.
FAMILIES = ["llama", "qwen2", "phi3", "qwen3", "gemma3_text", "mistral", "ministral3", "gemma2"]


def assert_close(a: mx.array, b: mx.array) -> None:
    # One forward over the tree and one per path multiply matrices of other shapes: BLAS may
    # sum in another order, so the bound scales with the values (real logits reach ~10).
    assert_float32_close(np.array(a), np.array(b))


def tree_forward(model, prefix: list[int], tree: Tree, tokens: list[int]):
    """Prefill `prefix`, then one forward over the tree's node tokens; returns (output, cache)."""
    cache = model.make_cache()
    model(mx.array([prefix]), cache)
    offset = cache.offset
    out = model(
        mx.array([tokens]),
        cache,
        positions=tree.positions(offset),
        mask=tree.attention_mask(offset),
    )
    return out, cache


def path_forward(model, prefix: list[int], tokens: list[int]):
    cache = model.make_cache()
    model(mx.array([prefix]), cache)
    return model(mx.array([tokens]), cache), cache


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def check_tree_against_paths(model, tree: Tree, prefix: list[int], tokens: list[int]) -> None:
    out, _ = tree_forward(model, prefix, tree, tokens)
    for path in tree.paths():
        index = mx.array(path)
        sequential, _ = path_forward(model, prefix, [tokens[i] for i in path])
        assert_close(out.logits[0][index], sequential.logits[0])
        assert_close(out.hidden[0][index], sequential.hidden[0])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tree_forward_equals_path_forwards(model_type):
    tree = Tree.from_paths(CHOICES)
    assert tree.depth >= 3 and max(len(tree.children(i)) for i in range(16)) >= 2
    model = tiny_model(model_type, seed=3)
    vocab = model.args.vocab_size
    check_tree_against_paths(
        model, tree, random_tokens(9, vocab, 0), random_tokens(tree.num_nodes, vocab, 1)
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_compaction_equals_fresh_forward_over_the_path(model_type):
    tree = Tree.from_paths(CHOICES)
    model = tiny_model(model_type, seed=4)
    vocab = model.args.vocab_size
    prefix = random_tokens(7, vocab, 2)
    tokens = random_tokens(tree.num_nodes, vocab, 3)
    for path in tree.paths():
        _, cache = tree_forward(model, prefix, tree, tokens)
        start = len(prefix)
        cache.compact(start, mx.array(path))
        cache.truncate(start + len(path))
        path_tokens = [tokens[i] for i in path]
        _, fresh = path_forward(model, prefix, path_tokens)
        assert cache.offset == fresh.offset == len(prefix) + len(path)
        for ours, theirs in zip(cache.keys + cache.values, fresh.keys + fresh.values, strict=True):
            assert_close(ours[..., : cache.offset, :], theirs[..., : fresh.offset, :])
        # Decoding goes on from the compacted cache exactly as from the fresh one.
        nxt = mx.array([[5]])
        assert_close(model(nxt, cache).logits, model(nxt, fresh).logits)


@pytest.mark.parametrize("folder", ["stories260K-llama", "stories260K-qwen2", "stories260K-phi3"])
def test_published_tree_on_real_checkpoints(folder):
    """mc_sim_7b_63 (64 nodes, depth 4) on the real stories260K target, all three layouts."""
    model, _ = load_model(MODELS / folder)
    tree = Tree.from_paths(MEDUSA_TREES["mc_sim_7b_63"])
    prefix = [1, 403, 407, 261, 54, 29]
    check_tree_against_paths(model, tree, prefix, random_tokens(tree.num_nodes, 512, 5))
