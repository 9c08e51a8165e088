"""Keeping the ranks of an `mx.distributed` group honest: the same model everywhere, and no
hang when one of them dies or stops answering.

A rank that exits closes its sockets, and the ring backend fails the others' next collective
with a RuntimeError ("connection to a peer was lost"): `guarded` turns it into a one-line
ConnectionError. A rank that hangs (alive, never reaching the next collective) would block the
others forever inside `mx.eval`, where Python cannot interrupt them; a watchdog thread ends
this rank with a one-line message when no step completes within `timeout` seconds. Its exit
closes its own sockets, and `mlx.launch` stops the remaining ranks once one exits non-zero.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

DEFAULT_TIMEOUT = 300.0  # seconds without a finished step: a long prompt on a large model fits
HUNG = 75  # the exit status of a rank the watchdog ended
_DIGEST_WORDS = 4  # 128 bits of the digest are compared


class Watchdog:
    """Ends the process (status HUNG, one line on stderr) when `beat` was not called for
    `timeout` seconds while armed. A daemon thread: it syncs with nothing, it only reads the
    deadline the main thread moves."""

    def __init__(self, rank: int, timeout: float):
        if timeout <= 0:
            raise ValueError(f"the rank timeout must be positive, got {timeout}")
        self.rank = rank
        self.timeout = timeout
        self._deadline: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """A step finished: the next one has `timeout` seconds."""
        self._deadline = time.monotonic() + self.timeout

    def pause(self) -> None:
        """Waiting is expected from here on (a server between requests)."""
        self._deadline = None

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout / 4)):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"error: rank {self.rank}: no step finished in {self.timeout:g} s: another "
                    "rank died or hangs (--rank-timeout sets the limit); stopping",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(HUNG)


@contextmanager
def guarded(group: mx.distributed.Group, timeout: float = DEFAULT_TIMEOUT) -> Iterator[Watchdog]:
    """Runs the body with an armed Watchdog (the body beats it after each step); a peer lost
    inside raises ConnectionError with a one-line message naming this rank."""
    watchdog = Watchdog(group.rank(), timeout)
    watchdog.beat()
    try:
        yield watchdog
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        raise ConnectionError(
            f"rank {group.rank()}: lost the connection to another rank (it exited or its "
            f"machine went away): {' '.join(str(e).split())}"
        ) from e
    finally:
        watchdog.stop()


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another rank's connection closed."""
    return isinstance(error, RuntimeError) and ("[ring]" in str(error) or "peer" in str(error))


def model_digest(config: Mapping[str, Any] | Any, model: nn.Module) -> bytes:
    """A digest of a model's config and its parameters' names, shapes and dtypes: cheap (no
    weight is read) and equal for the same checkpoint on any machine."""
    shapes = sorted((k, list(v.shape), str(v.dtype)) for k, v in tree_flatten(model.parameters()))
    text = json.dumps([config, shapes], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def drafter_digest(spec: Any) -> bytes:
    """A digest of a resolved drafter spec (a frozen dataclass): its method, its settings and
    the config and parameter shapes of what it loaded (a draft model, heads). Not its
    tokenizer: the draft model's vocabulary check covers it."""
    parts = [spec.method]
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if isinstance(value, nn.Module):
            parts.append(model_digest(getattr(value, "args", None), value).hex())
        elif field.name != "tokenizer":
            parts.append(f"{field.name}={value!r}")
    return hashlib.sha256("\n".join(parts).encode()).digest()


def check_same_model(digest: bytes, group: mx.distributed.Group, what: str = "model") -> None:
    """ValueError naming the ranks, unless every rank of `group` passed the same digest (one
    all_gather of 16 bytes per rank)."""
    words = mx.array(list(digest[: 4 * _DIGEST_WORDS]), mx.int32)  # (16,) bytes as int32
    every = mx.distributed.all_gather(words[None], group=group)  # (ranks, 16)
    rows = [tuple(r) for r in every.tolist()]
    if len(set(rows)) == 1:
        return
    groups: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(row, []).append(rank)
    sides = " vs ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for r in groups.values()
    )
    raise ValueError(
        f"the ranks loaded different {what}s ({sides}): their configs, settings or weight "
        "shapes differ; every rank must load the same ones"
    )
