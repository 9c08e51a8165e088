"""Stage 3, the training loop: AdamW with warmup and cosine decay, gradient clipping, a compiled
step, held-out top-1 accuracy per epoch with early stopping, and checkpoints to resume from.

Batches are whole conversations padded to a power of two (at least 32) tokens, as many as
`batch_tokens` holds (rows left over are empty), so the compiled step sees a few shapes. Their
order is a seeded shuffle per epoch, the head's initialisation is seeded, and the noise key of
each step is derived from its number, so a run resumed from a checkpoint continues exactly as
the uninterrupted run would have.

Many small steps learn faster than few large ones: on a small data set, held-out top-1 fell
as batches grew past a few hundred tokens, at each learning rate tried.

`checkpoint/` (replaced atomically) holds the head's and the optimizer's state, where the run
stands and `key.json`, what the head is and was trained from; a Ctrl-C saves one before it
exits. A run resumes a checkpoint of its own key only: schedule settings (epochs, learning
rate, batch tokens, ...) may change between runs, the head and its data may not.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic import move_into_place, staging_folder
from ..checkpoint import read_weights, write_safetensors
from .features import Features
from .keys import differences, read_key, write_json
from .settings import TrainConfig

CHECKPOINT, KEY_FILE = "checkpoint", "key.json"
# Vocabulary rows a batch's answer count is rounded up to. On a CPU the vocabulary-wide
# softmax is most of a step, so coarser rounding pays for rows of padding. The step is traced
# once per (T, rows) shape either way.
ROWS = 32


@dataclass
class Progress:
    epoch: int = 0
    batch: int = 0  # batches of the current epoch done
    step: int = 0
    best: float = -1.0  # best held-out accuracy
    stale: int = 0  # epochs since it improved
    history: list[dict] = field(default_factory=list)


def split(count: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) conversation indices."""
    order = np.random.default_rng(seed).permutation(count)
    held = min(count - 1, max(1, round(count * holdout))) if holdout > 0 and count > 1 else 0
    return np.sort(order[held:]), np.sort(order[:held])


def batches(data: Features, rows: np.ndarray, budget: int, seed: int | None) -> list[np.ndarray]:
    """Groups of conversations of similar length, at most `budget` padded tokens each (one
    conversation at least), in a seeded random order (None: in order)."""
    lengths = np.array([data.starts[i + 1] - data.starts[i] for i in rows])
    order = rows[np.argsort(lengths, kind="stable")]
    groups, current, longest = [], [], 0
    for i in order:
        padded = _padded(int(data.starts[i + 1] - data.starts[i]))
        if current and max(longest, padded) * (len(current) + 1) > budget:
            groups.append(np.array(current))
            current, longest = [], 0
        current.append(i)
        longest = max(longest, padded)
    if current:
        groups.append(np.array(current))
    if seed is not None:
        groups = [groups[j] for j in np.random.default_rng(seed).permutation(len(groups))]
    return groups


def _padded(n: int) -> int:
    return max(32, 1 << (n - 1).bit_length())


def collate(data: Features, group: np.ndarray, budget: int) -> tuple[mx.array, ...]:
    """(tokens, answer, features, top_ids, top_logits) zero-padded to (budget // T, T), and
    `counted` (N,): the flat indices (b * T + s) of the answer tokens, -1 past them, N rounded
    up to a multiple of `ROWS` so that the compiled step sees a few shapes. The losses project
    onto the vocabulary only there: padding and prompts cost no 49k-wide rows."""
    T = _padded(max(int(data.starts[i + 1] - data.starts[i]) for i in group))
    B = max(len(group), budget // T)
    out = []
    for name in ("tokens", "answer", "features", "top_ids", "top_logits"):
        source = getattr(data, name)
        array = np.zeros((B, T, *source.shape[1:]), dtype=source.dtype)
        for b, i in enumerate(group):
            rows = data.rows(int(i))
            array[b, : rows.stop - rows.start] = source[rows]
        out.append(array.astype(np.float32) if array.dtype == np.float16 else array)
    counted = np.flatnonzero(out[1])
    index = np.full(min(B * T, max(ROWS, -(-len(counted) // ROWS) * ROWS)), -1, dtype=np.int32)
    index[: len(counted)] = counted
    return tuple(mx.array(a) for a in (*out, index))


def train(
    head: nn.Module,
    loss_fn: Callable,
    frozen: tuple[mx.array, ...],
    data: Features,
    folder: Path,
    config: TrainConfig,
    progress: bool = True,
    built_from: dict[str, Any] | None = None,
) -> Progress:
    """Trains `head` on `data` (resuming from `folder/checkpoint`), leaves it holding the
    weights of its best held-out epoch; returns the run's record. `loss_fn(head, batch,
    *frozen, key)` -> (loss, (hits, count)), `key` None when evaluating. `built_from`
    (keys.py): what the head is and was trained from, saved with each checkpoint; a
    checkpoint saved under another is refused (`check_checkpoint`)."""
    train_rows, held_rows = split(data.conversations, config.holdout, config.seed)
    per_epoch = len(batches(data, train_rows, config.batch_tokens, None))
    total = config.max_steps or config.epochs * per_epoch
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(1e-7, config.learning_rate, max(1, config.warmup)),
            optim.cosine_decay(
                config.learning_rate, max(1, total - config.warmup), config.learning_rate * 0.1
            ),
        ],
        [max(1, config.warmup)],
    )
    optimizer = optim.AdamW(schedule, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    optimizer.init(head.trainable_parameters())
    check_checkpoint(folder, built_from)
    state = _resume(folder / CHECKPOINT, head, optimizer)
    if progress and state.step:
        print(f"resuming {folder / CHECKPOINT} at epoch {state.epoch + 1}, step {state.step}")
    grad_fn = nn.value_and_grad(head, lambda h, *a: loss_fn(h, *a)[0])
    compiled_state = [head.state, optimizer.state]

    @partial(mx.compile, inputs=compiled_state, outputs=compiled_state)
    def step(batch, key):
        loss, grads = grad_fn(head, batch, *frozen, key)
        grads, _ = optim.clip_grad_norm(grads, config.clip)
        optimizer.update(head, grads)
        return loss

    def eval_fn(batch):
        return loss_fn(head, batch, *frozen, None)

    from tqdm import tqdm

    best_file = folder / CHECKPOINT / "best.safetensors"
    while state.epoch < config.epochs and state.step < total:
        groups = batches(data, train_rows, config.batch_tokens, config.seed + state.epoch)
        bar = tqdm(
            total=len(groups),
            initial=state.batch,
            desc=f"epoch {state.epoch + 1}",
            disable=not progress,
        )
        try:
            for group in groups[state.batch :]:
                key = mx.random.key(config.seed * 1_000_003 + state.step)
                loss = step(collate(data, group, config.batch_tokens), key)
                mx.eval(loss, head.state, optimizer.state)
                state.batch, state.step = state.batch + 1, state.step + 1
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update()
                if state.step % config.save_every == 0 or state.step >= total:
                    _save(folder / CHECKPOINT, head, optimizer, state, built_from)
                if state.step >= total:
                    break
        except KeyboardInterrupt:
            _save(folder / CHECKPOINT, head, optimizer, state, built_from)
            raise
        finally:
            bar.close()
        if state.batch < len(groups):
            break  # max_steps reached mid-epoch
        accuracy = evaluate(eval_fn, data, held_rows, config.batch_tokens)
        state.history.append(
            {
                "epoch": state.epoch + 1,
                "step": state.step,
                "loss": float(loss.item()),
                "held_out_top1": accuracy,
            }
        )
        if progress:
            print(f"epoch {state.epoch + 1}: held-out top-1 {accuracy:.1%}", flush=True)
        state.epoch, state.batch = state.epoch + 1, 0
        if accuracy > state.best:
            state.best, state.stale = accuracy, 0
            _save(folder / CHECKPOINT, head, optimizer, state, built_from, best=True)
        else:
            state.stale += 1
            _save(folder / CHECKPOINT, head, optimizer, state, built_from)
            if state.stale >= config.patience:
                break
    if best_file.exists():
        head.load_weights(str(best_file))
    return state


def evaluate(eval_fn: Callable, data: Features, rows: np.ndarray, budget: int) -> float:
    """Top-1 accuracy of the first draft token over the held-out conversations (nan: none),
    without training noise."""
    hits = count = 0.0
    for group in batches(data, rows, budget, None):
        _, (h, c) = eval_fn(collate(data, group, budget))
        hits, count = hits + h.item(), count + c.item()
    return hits / count if count else math.nan


def check_checkpoint(folder: Path, key: dict[str, Any] | None) -> None:
    """Nothing when `folder` holds no checkpoint, or one saved under `key` (None: any); else a
    ValueError naming what differs. Its weights are not deleted: a run of hours is not
    discarded for a changed flag."""
    checkpoint = folder / CHECKPOINT
    if key is None or not (checkpoint / "progress.json").exists():
        return
    old = read_key(checkpoint / KEY_FILE)
    if old == key:
        return
    what = (
        "has no record of the settings it was trained with (an older version wrote it)"
        if old is None
        else f"was trained with other settings ({differences(old, key)})"
    )
    raise ValueError(
        f"the checkpoint in {checkpoint} {what}: delete it to train afresh, or give another cache"
    )


def _save(
    folder: Path,
    head: nn.Module,
    optimizer,
    state: Progress,
    key: dict[str, Any] | None,
    best: bool = False,
) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_folder(folder)
    if key is not None:
        write_json(tmp / KEY_FILE, key)
    write_safetensors(tmp / "head.safetensors", dict(tree_flatten(head.parameters())))
    opt = {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}
    write_safetensors(tmp / "optimizer.safetensors", opt)
    old_best = folder / "best.safetensors"
    if best:
        write_safetensors(tmp / "best.safetensors", dict(tree_flatten(head.parameters())))
    elif old_best.exists():
        (tmp / "best.safetensors").write_bytes(old_best.read_bytes())
    (tmp / "progress.json").write_text(json.dumps(state.__dict__))
    move_into_place(tmp, folder)


def _resume(folder: Path, head: nn.Module, optimizer) -> Progress:
    if not (folder / "progress.json").exists():
        return Progress()
    try:
        state = Progress(**json.loads((folder / "progress.json").read_text()))
        head.load_weights(list(read_weights([folder / "head.safetensors"]).items()))
        saved = read_weights([folder / "optimizer.safetensors"])
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"the checkpoint in {folder} is corrupt ({e}); delete it") from None
    optimizer.state = tree_unflatten(list(saved.items()))
    return state
