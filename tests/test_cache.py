"""Preallocated KV cache: chunked growth, O(1) truncation, compaction, random edit sequences."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.cache import KVCache
from mlx_speculate.loading import build_model

from .helpers import random_weights, tiny_config, tree_inputs, tree_path

LAYERS = 2


def kv(length: int, seed: int) -> tuple[mx.array, mx.array]:
    """Random (1, 2, length, 4) keys and values."""
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, 2, length, 4), key=k1), mx.random.normal((1, 2, length, 4), key=k2)


def write(cache: KVCache, keys: mx.array, values: mx.array) -> list[tuple[mx.array, mx.array]]:
    """One forward's cache traffic: the same write in every layer, then advance."""
    out = [cache.update(layer, keys, values) for layer in range(LAYERS)]
    cache.advance(keys.shape[2])
    return out


def cat(*arrays: mx.array) -> mx.array:
    return mx.concatenate(arrays, axis=2)


def test_capacity_grows_in_step_chunks():
    """One-token writes grow storage a chunk at a time, never per token."""
    cache = KVCache(LAYERS, step=8)
    capacities = []
    for t in range(20):
        write(cache, *kv(1, t))
        capacities.append(cache.capacity)
    assert capacities == [8] * 8 + [16] * 8 + [24] * 4
    assert all(k.shape[2] == 24 for k in cache.keys + cache.values)


def test_write_beyond_capacity_keeps_committed_prefix():
    """A write that crosses the capacity returns the committed prefix followed by the new keys."""
    cache = KVCache(LAYERS, step=8)
    k1, v1 = kv(7, 0)
    k2, v2 = kv(5, 1)
    write(cache, k1, v1)
    for keys, values in write(cache, k2, v2):
        assert mx.array_equal(keys, cat(k1, k2)) and mx.array_equal(values, cat(v1, v2))
    assert cache.capacity == 16 and cache.offset == 12


def test_truncate_is_o1_and_later_writes_start_there():
    """truncate only moves the offset; the next write lands right after the kept prefix."""
    cache = KVCache(LAYERS, step=8)
    k1, v1 = kv(6, 0)
    write(cache, k1, v1)
    storage = cache.keys[0]
    cache.truncate(2)
    assert cache.offset == 2 and cache.keys[0] is storage and cache.capacity == 8
    k2, v2 = kv(9, 1)  # also crosses the capacity: only the 2 kept slots are carried over
    for keys, values in write(cache, k2, v2):
        assert mx.array_equal(keys, cat(k1[..., :2, :], k2))
        assert mx.array_equal(values, cat(v1[..., :2, :], v2))
    cache.truncate(cache.offset)
    cache.truncate(0)
    assert cache.offset == 0


@pytest.mark.parametrize("length", [-1, 7])
def test_truncate_out_of_range_is_an_error(length):
    """Truncating below zero or past the offset raises a ValueError naming both numbers."""
    cache = KVCache(LAYERS)
    write(cache, *kv(6, 0))
    with pytest.raises(ValueError, match=f"cache of 6 slots to {length}"):
        cache.truncate(length)
    assert cache.offset == 6


def test_compact_moves_kept_slots_to_the_start():
    """compact(start, path) packs slots start + path[i] at start + i in every layer; the
    offset is the caller's."""
    cache = KVCache(LAYERS, step=8)
    keys, values = kv(8, 0)
    write(cache, keys, values)
    cache.compact(3, mx.array([1, 3, 4]))  # slots 4, 6, 7
    cache.truncate(6)
    index = mx.array([0, 1, 2, 4, 6, 7])
    for layer in range(LAYERS):
        assert mx.array_equal(cache.keys[layer][..., :6, :], keys[..., index, :])
        assert mx.array_equal(cache.values[layer][..., :6, :], values[..., index, :])
    k2, v2 = kv(3, 1)
    out_keys, _ = write(cache, k2, v2)[0]
    assert mx.array_equal(out_keys, cat(keys[..., index, :], k2))


def test_compact_of_consecutive_slots_keeps_them():
    cache = KVCache(LAYERS)
    keys, values = kv(6, 0)
    write(cache, keys, values)
    cache.compact(2, mx.array([0, 1]))
    cache.truncate(4)
    assert mx.array_equal(cache.keys[1][..., :4, :], keys[..., :4, :])


def test_compact_takes_a_lazy_start_and_path():
    """A compiled step compacts with the slot start and the accepted path still lazy."""
    cache = KVCache(LAYERS, step=8)
    keys, values = kv(8, 0)
    write(cache, keys, values)
    start, path = mx.array(2, mx.int32) + 0, mx.array([0, 2, 5]) * 1
    cache.compact(start, path)
    cache.truncate(5)
    index = mx.array([0, 1, 2, 4, 7])
    assert mx.array_equal(cache.keys[0][..., :5, :], keys[..., index, :])


def assert_probe_matches(model, cache: KVCache, committed: list[int], probe: int) -> None:
    """A probe token's logits through the cache equal a fresh forward; the probe is then undone."""
    cached = model(mx.array([[probe]]), cache).logits[0, -1]
    fresh = model(mx.array([committed + [probe]])).logits[0, -1]
    cache.truncate(cache.offset - 1)
    err, scale = mx.abs(cached - fresh).max().item(), mx.abs(fresh).max().item()
    assert err < 1e-5 * scale, f"relative error {err / scale:.3g} after {len(committed)} tokens"


@pytest.mark.parametrize(
    "model_type, overrides, seed",
    [
        ("llama", {}, 0),
        ("llama", {}, 5),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, 6),
        ("phi3", {}, 7),
    ],
    ids=["llama", "llama-seed5", "qwen2-window", "phi3"],
)
def test_random_edits_match_a_fresh_forward(model_type, overrides, seed):
    """Through random forwards, truncations and tree-path compactions, a probe token's logits
    equal a fresh forward over the committed tokens."""
    config = tiny_config(model_type, **overrides)
    model = build_model(config, random_weights(config))
    vocab = config["vocab_size"]
    rng = np.random.default_rng(seed)
    cache = KVCache(LAYERS, step=8)  # small chunks: growth happens between the edits
    committed: list[int] = []
    scattered = 0  # compactions that really move keys
    for _ in range(30):
        op = rng.choice(["forward", "truncate", "tree"], p=[0.4, 0.25, 0.35])
        if op == "forward":
            tokens = rng.integers(0, vocab, int(rng.integers(1, 5))).tolist()
            model(mx.array([tokens]), cache)
            committed += tokens
        elif op == "truncate":
            cache.truncate(int(rng.integers(max(0, cache.offset - 6), cache.offset + 1)))
            committed = committed[: cache.offset]
        else:  # verify a random tree, keep one root-to-node path
            size = int(rng.integers(2, 8))
            parents = [-1] + [int(rng.integers(0, i)) for i in range(1, size)]
            tokens = rng.integers(0, vocab, size).tolist()
            start = cache.offset
            positions, mask = tree_inputs(parents, start)
            model(mx.array([tokens]), cache, positions=positions, mask=mask)
            path = tree_path(parents, int(rng.integers(0, size)))
            cache.compact(start, mx.array(path))
            cache.truncate(start + len(path))
            committed += [tokens[i] for i in path]
            scattered += path != list(range(len(path)))
        assert cache.offset == len(committed)
        assert_probe_matches(model, cache, committed, int(rng.integers(0, vocab)))
    assert len(committed) > 15 and cache.capacity > 8 and scattered >= 3


def test_span_grows_two_sizes_an_octave_within_the_capacity():
    cache = KVCache(LAYERS, step=256, like=mx.zeros((1, 2, 0, 4)))
    cache.reserve(200)  # capacity 256
    assert [cache.span(e) for e in (1, 64, 65, 97, 129, 200)] == [64, 64, 96, 128, 192, 256]
    cache.reserve(300)  # capacity 512
    assert [cache.span(e) for e in (257, 300, 385, 512)] == [384, 384, 512, 512]
