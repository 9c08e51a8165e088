"""What generation does on the device besides computing: mlx-lm's habits for Metal.

- One dedicated generation stream (thread-local, as mlx-lm's), so a server's other work on the
  default stream does not queue behind decoding.
- The wired memory limit raised to the model's size while generating, so Metal keeps the
  weights resident (only where Metal is available; nothing else has a wired limit).
- `clear_cache()` returns the allocator's cached buffers: a server calls it between requests.
- `roomy_cache(limit)` keeps freed buffers up to `limit` (at most the memory limit, as Metal
  does by default), where MLX's CPU allocator keeps 32 MB: training's vocabulary-wide arrays
  (44 MB for 224 rows of SmolLM2) would otherwise go back to the OS and fault in again at
  every step. Bounded, because the cache only grows: each new buffer size stays resident.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
from mlx.utils import tree_flatten

GENERATION_STREAM = mx.new_thread_local_stream(mx.default_device())


@contextmanager
def wired_limit(model) -> Iterator[None]:
    """Raises the wired limit to the model's weight size (at most the device's recommended
    working set) while the block runs; a no-op without Metal."""
    if not mx.metal.is_available():
        yield
        return
    size = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    limit = min(size, mx.device_info()["max_recommended_working_set_size"])
    old = mx.set_wired_limit(limit)
    try:
        yield
    finally:
        # The limit must not change under a running evaluation.
        mx.synchronize(GENERATION_STREAM)
        mx.set_wired_limit(old)


def clear_cache() -> None:
    """Frees the allocator's cached buffers (between server requests, say)."""
    mx.clear_cache()


@contextmanager
def roomy_cache(limit: int) -> Iterator[None]:
    """The allocator's cache limit raised to `limit` bytes (at most the memory limit; never
    lowered) while the block runs, its cache emptied after. Why: on the CPU a large graph (a
    training cross-entropy's forward and backward) otherwise frees and reallocates its buffers
    on every call, and the cap keeps what it holds bounded."""
    new = min(limit, mx.get_memory_limit())
    old = mx.set_cache_limit(new)
    if old > new:
        mx.set_cache_limit(old)  # never lowered
    try:
        yield
    finally:
        mx.set_cache_limit(old)
        mx.clear_cache()
