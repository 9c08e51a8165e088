"""The feature queue of head drafters: rows wait after the fed positions, and a rewind drops
the rows or the cache's slots past the committed length, never both sides wrong."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_speculate.cache import KVCache
from mlx_speculate.drafters.features import FeatureQueue


def rows(start: int, n: int) -> mx.array:
    """(n, 2) rows whose first column is their position."""
    positions = mx.arange(start, start + n, dtype=mx.float32)[:, None]
    return mx.concatenate([positions, -positions], axis=1)


def fed_queue(fed: int) -> FeatureQueue:
    """A queue whose cache holds `fed` written slots and that has run the rows of all of them."""
    cache = KVCache(1)
    keys = mx.zeros((1, 1, fed, 4))
    cache.update(0, keys, keys)
    cache.advance(fed)
    queue = FeatureQueue(cache)
    queue.add(rows(0, fed))
    queue.mark_fed(fed)
    return queue


def test_rows_wait_in_order_until_fed():
    queue = fed_queue(3)
    assert queue.rows() is None and queue.waiting == 0
    queue.add(rows(3, 2))
    queue.add(mx.zeros((0, 2)))  # no positions: nothing waits for it
    queue.add(rows(5, 1))
    assert (queue.fed, queue.known, queue.waiting) == (3, 6, 3)
    np.testing.assert_array_equal(np.array(queue.rows()[:, 0]), [3, 4, 5])
    queue.mark_fed(6)
    assert (queue.fed, queue.known, queue.rows()) == (6, 6, None)


def test_rewind_within_the_waiting_rows_keeps_the_cache():
    queue = fed_queue(3)
    queue.add(rows(3, 4))
    assert queue.rewind(5) is False
    assert (queue.fed, queue.known, queue.cache.offset) == (3, 5, 3)
    np.testing.assert_array_equal(np.array(queue.rows()[:, 0]), [3, 4])
    assert queue.rewind(3) is False  # every waiting row dropped, the fed ones kept
    assert (queue.fed, queue.known, queue.rows()) == (3, 3, None)


def test_rewind_into_the_fed_positions_truncates_the_cache():
    queue = fed_queue(5)
    queue.add(rows(5, 2))
    assert queue.rewind(2) is True
    assert (queue.fed, queue.known, queue.cache.offset, queue.rows()) == (2, 2, 2, None)


def test_rewind_past_what_it_knows_changes_nothing():
    queue = fed_queue(4)
    queue.add(rows(4, 1))
    assert queue.rewind(5) is False and queue.rewind(9) is False
    assert (queue.fed, queue.known, queue.cache.offset, queue.waiting) == (4, 5, 4, 1)


def test_rewind_never_lengthens_a_shorter_cache():
    # Truncation only shortens: a cache that holds fewer slots than the length stays so.
    queue = fed_queue(4)
    queue.cache.truncate(2)
    assert queue.rewind(3) is True
    assert (queue.fed, queue.known, queue.cache.offset) == (3, 3, 2)
