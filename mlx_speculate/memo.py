"""What is made once per loaded model and reused while it lives: compiled graphs (`step`), and
heads or draft models loaded from a folder, so that `stream_generate(..., eagle="heads/")` in a
loop neither reads the files again nor traces the head's graphs again (keyed by the head)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Table = dict[int, dict[tuple, Any]]  # per model id, dropped with the model

_LOADED: Table = {}  # what `from_folder` loaded


def per_model(table: Table, model: Any, key: tuple, build: Callable[[], T]) -> T:
    """`table`'s entry `key` for `model`, made by `build()` the first time."""
    entries = table.get(id(model))
    if entries is None:
        entries = table[id(model)] = {}
        weakref.finalize(model, table.pop, id(model), None)
    if key not in entries:
        entries[key] = build()
    return entries[key]


def from_folder(model: Any, kind: str, path: str | Path, load: Callable[[], T]) -> T:
    """`load()`'s result for `path` (a folder, file or hub id) beside `model`, loaded again
    only when a file there changed."""
    return per_model(_LOADED, model, (kind, *_signature(path)), load)


def _signature(path: str | Path) -> tuple:
    p = Path(path).expanduser()
    if not p.exists():
        return (str(path),)  # a hub id: the snapshot it names does not change under us
    p = p.resolve()
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    stats = [(f.name, f.stat()) for f in files if f.is_file()]
    return (str(p), *((name, st.st_mtime_ns, st.st_size) for name, st in stats))
