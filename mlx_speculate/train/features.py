"""Stage 2, features: one teacher-forced target forward per conversation, stored memory-mapped.

What a head trains on, per token (float16 features; N tokens, h the target's width, k the
kept logits):
- `tokens.npy` int32 (N,), `answer.npy` uint8 (N,): 1 on tokens the target wrote,
- `starts.npy` int64 (C + 1,): where each conversation starts,
- `features.npy` float16 (N, F): what `head.inputs` reads (EAGLE-1, Medusa: the final state,
  F = h; EAGLE-3: the states entering its tapped layers, F = taps x h),
- `top_ids.npy` int32 (N, k), `top_logits.npy` float16 (N, k): the target's k likeliest next
  tokens and their logits (the distribution losses compare against, renormalised over them),
  from the token before the answer on (0 before: no loss reads them).
Disk: 5 + 2F + 6k bytes a token (SmolLM2, k 16: 1.25 KB for EAGLE-1/Medusa, 3.6 KB for EAGLE-3).

`meta.json` is the cache's key (keys.py): its shapes, the target and the conversations it was
made from; a run with other ones makes it again. `progress.json` counts the conversations
written; it is replaced (atomically) only after the arrays are flushed, so a killed run redoes
at most one conversation.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..models.base import CausalLM
from .data import Conversation
from .keys import differences, digest, model_identity, write_json

META, PROGRESS = "meta.json", "progress.json"
ARRAYS = ("tokens", "answer", "starts", "features", "top_ids", "top_logits")


@dataclass(frozen=True)
class Features:
    """The memory-mapped arrays of a complete feature cache."""

    tokens: np.ndarray
    answer: np.ndarray
    starts: np.ndarray
    features: np.ndarray
    top_ids: np.ndarray
    top_logits: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in ARRAYS)

    @property
    def conversations(self) -> int:
        return self.starts.shape[0] - 1

    def rows(self, i: int) -> slice:
        return slice(int(self.starts[i]), int(self.starts[i + 1]))


def make_features(
    model: CausalLM,
    conversations: Sequence[Conversation],
    folder: Path,
    taps: tuple[int, ...],
    width: int,
    top_k: int = 16,
    progress: bool = True,
) -> Features:
    """The feature cache in `folder` for `conversations`, resumed or made; `taps` empty means
    the final states (`width` = hidden size), else the concatenated taps."""
    lengths = [len(c.tokens) for c in conversations]
    meta = {
        "conversations": len(lengths),
        "tokens": sum(lengths),
        "taps": list(taps),
        "width": width,
        "top_k": top_k,
        "model": model_identity(model),
        "data": digest([[c.tokens, c.answer] for c in conversations]),
    }
    done = 0
    old = _read_json(folder / META) if (folder / META).exists() else None
    if old is not None and old != meta:
        if progress:
            changed = differences(old, meta)
            print(f"features: made from other data or settings ({changed}): made again")
        shutil.rmtree(folder)
        old = None
    folder.mkdir(parents=True, exist_ok=True)
    if old is not None:
        done = int(_read_json(folder / PROGRESS).get("done", 0))
        arrays = {name: _open(folder, name, "r+") for name in ARRAYS}
    else:
        n, c = meta["tokens"], meta["conversations"]
        shapes = {
            "tokens": ((n,), np.int32),
            "answer": ((n,), np.uint8),
            "starts": ((c + 1,), np.int64),
            "features": ((n, width), np.float16),
            "top_ids": ((n, top_k), np.int32),
            "top_logits": ((n, top_k), np.float16),
        }
        arrays = {
            name: np.lib.format.open_memmap(folder / f"{name}.npy", "w+", dtype, shape)
            for name, (shape, dtype) in shapes.items()
        }
        arrays["starts"][:] = np.concatenate([[0], np.cumsum(lengths)])
        write_json(folder / PROGRESS, {"done": 0})
        write_json(folder / META, meta)
    from tqdm import tqdm

    starts = arrays["starts"]
    with tqdm(total=len(lengths), initial=done, desc="features", disable=not progress) as bar:
        for i in range(done, len(lengths)):
            c, rows = conversations[i], slice(int(starts[i]), int(starts[i + 1]))
            out = model(mx.array([c.tokens]), taps=taps)
            feats = mx.concatenate(out.taps, axis=-1) if taps else out.hidden  # (1, n, F)
            # Only the positions before answer tokens have a distribution that a loss reads:
            # the 49k-wide projection and its top-k skip the prompt (a quarter of SmolLM2's).
            first = max(c.answer - 1, 0)
            logits = model.project(out.hidden[0, first:]).astype(mx.float32)
            ids = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k]
            top = mx.take_along_axis(logits, ids, axis=-1)
            order = mx.argsort(-top, axis=-1)  # best first
            arrays["tokens"][rows] = c.tokens
            arrays["answer"][rows] = np.arange(len(c.tokens)) >= c.answer
            arrays["features"][rows] = np.array(feats[0].astype(mx.float32))
            split = rows.start + first
            prompt, after = slice(rows.start, split), slice(split, rows.stop)
            arrays["top_ids"][prompt], arrays["top_logits"][prompt] = 0, 0
            arrays["top_ids"][after] = np.array(mx.take_along_axis(ids, order, axis=-1))
            arrays["top_logits"][after] = np.array(mx.take_along_axis(top, order, axis=-1))
            if (i + 1) % 16 == 0 or i + 1 == len(lengths):
                for a in arrays.values():
                    a.flush()
                write_json(folder / PROGRESS, {"done": i + 1})
            bar.update()
    return open_features(folder)


def open_features(folder: Path) -> Features:
    """A complete feature cache, checked against its meta.json (ValueError when it is not)."""
    meta, progress = _read_json(folder / META), _read_json(folder / PROGRESS)
    if progress.get("done") != meta.get("conversations"):
        raise ValueError(f"the feature cache in {folder} is incomplete; run the stage again")
    arrays = {name: _open(folder, name, "r") for name in ARRAYS}
    n, k, width = meta["tokens"], meta["top_k"], meta["width"]
    expected = {
        "tokens": (n,),
        "answer": (n,),
        "starts": (meta["conversations"] + 1,),
        "features": (n, width),
        "top_ids": (n, k),
        "top_logits": (n, k),
    }
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ValueError(
                f"the feature cache in {folder} is corrupt: {name}.npy has shape "
                f"{arrays[name].shape}, expected {shape}; delete it to recompute"
            )
    return Features(**arrays)


def _open(folder: Path, name: str, mode: str) -> np.ndarray:
    try:
        return np.load(folder / f"{name}.npy", mmap_mode=mode)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(
            f"the feature cache in {folder} is corrupt ({name}.npy: {e}); delete it to recompute"
        ) from None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"the feature cache file {path} is unreadable ({e}); delete it") from None
    if not isinstance(value, dict):
        raise ValueError(f"the feature cache file {path} is corrupt; delete it to recompute")
    return value
