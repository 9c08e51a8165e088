"""Stage 1, data: conversations the target wrote itself, cached on disk and resumable.

Prompts come from a JSON or JSONL file: a list of strings, or conversations in ShareGPT
(`{"conversations": [{"from": "human", "value": ...}]}`) or OpenAI (`{"messages": [...]}`)
form, whose turns up to the first assistant turn are the prompt. The target answers each with
its chat template (greedy; `temperature` > 0 samples instead), `batch` prompts at a time in
one left-padded batch (`answer`). A model without a chat template (the TinyStories models)
writes its own samples from BOS instead (`self_samples`): `sample_prefix` tokens drawn at T=1
so that the samples differ, then answered at `temperature` like a prompt (greedy by default:
the text greedy decoding will see).

`data.jsonl` holds one conversation a line, `{"tokens": [...], "answer": i}` (tokens from i on
are the target's own), appended and flushed one at a time; a killed run resumes after the last
complete line. `data-key.json` is what they were made from (`data_key`): a run with another
target, other prompts or settings makes them again instead of resuming.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..chat import apply_chat_template, has_chat_template
from ..cli import os_error
from ..models.base import CausalLM
from ..models.context import additive_mask
from ..sampling import SamplingParams, pick
from .keys import differences, digest, model_identity, read_key, write_json

DATA_FILE, KEY_FILE = "data.jsonl", "data-key.json"
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Conversation:
    tokens: tuple[int, ...]
    answer: int  # index of the first token the target wrote


def read_prompts(path: str | Path) -> list[str | list[dict[str, str]]]:
    """Prompts (a user message, or the messages before the first assistant turn) from `path`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read the prompt file: {os_error(e)}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read the prompt file {path}: {e}") from None
    if path.suffix == ".jsonl":
        return [_prompt(item, f"{path}:{n}") for n, item in _lines(text, path)]
    try:
        items = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as e:
        raise ValueError(f"the prompt file {path} is not valid JSON: {e}") from None
    if isinstance(items, dict):  # {"prompts": [...]} and the like
        items = next((v for v in items.values() if isinstance(v, list)), [])
    if not isinstance(items, list) or not items:
        raise ValueError(f"the prompt file {path} holds no prompts")
    return [_prompt(item, f"prompt {i} in {path}") for i, item in enumerate(items)]


def _lines(text: str, path: Path) -> list[tuple[int, Any]]:
    """(line number from 1, value) of each non-blank JSONL line; a bad one is named as
    file:line, the place an editor jumps to."""
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{n}: line {n} is not valid JSON ({e.msg}, column {e.colno})"
            ) from None
    if not items:
        raise ValueError(f"the prompt file {path} holds no prompts")
    return items


def _prompt(item: Any, where: str) -> str | list[dict[str, str]]:
    if isinstance(item, str) and item.strip():
        return item
    turns = None
    if isinstance(item, dict):
        turns = item.get("messages") or item.get("conversations")
        if turns is None and isinstance(item.get("prompt"), str):
            return item["prompt"]
    if isinstance(item, list):
        turns = item
    messages = []
    for turn in turns or []:
        if not isinstance(turn, dict):
            break
        role = _ROLES.get(str(turn.get("role", turn.get("from", ""))).lower())
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            break
        if role == "assistant":
            break
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: neither text nor a conversation: {item!r}"[:200])
    return messages


def answer(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    eos: Sequence[int],
    sampling: SamplingParams,
    key: mx.array,
) -> list[list[int]]:
    """The target's own continuations of `prompts` (any lengths), in one batch (greedy unless
    `sampling` says otherwise), each up to and including its first end token or
    `max_tokens[i]` tokens.

    Prompts are left-padded: no query sees a pad's key, and each row's rotary positions count
    from its own first token, so a row decodes as it would alone. A row that ends leaves the
    batch (its cache rows are dropped), so the step shrinks with the live rows. One host sync
    per token (the picked tokens); the batch and the cache capacity are the only shapes.
    A sliding-window model takes equal lengths only: its window is measured in cache slots.
    """
    if _windowed(model) and len({len(p) for p in prompts}) > 1:
        raise ValueError("a sliding-window model answers equal-length prompts only in a batch")
    longest = max(len(p) for p in prompts)
    pads = mx.array([longest - len(p) for p in prompts], dtype=mx.int32)[:, None]  # (B, 1)
    dtype = model.compute_dtype
    cols = mx.arange(longest, dtype=mx.int32)[None]  # (1, P)
    real = cols >= pads  # (B, P): the keys that are not padding
    causal = mx.tril(mx.ones((longest, longest), dtype=mx.bool_))
    # A pad's query sees itself only (its output is never read; a row must not be all -inf).
    allowed = causal & (real[:, None, :] | mx.eye(longest, dtype=mx.bool_))  # (B, P, P)
    tokens = mx.array([[0] * (longest - len(p)) + list(p) for p in prompts])  # (B, P)
    cache = model.make_cache()
    out = model(
        tokens,
        cache,
        positions=mx.maximum(cols - pads, 0),
        mask=additive_mask(allowed, dtype)[:, None],
    )
    # Only the last position is projected: the (B, P, vocabulary) logits are never evaluated.
    logits = model.project(out.hidden[:, -1])  # (B, V)
    rows: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))  # the prompt each batch row answers
    while True:
        key, sub = mx.random.split(key)
        token, _ = pick(logits, sampling, sub)  # (B,)
        keep = []
        for b, t in enumerate(token.tolist()):
            i = live[b]
            rows[i].append(t)
            if t not in eos and len(rows[i]) < max_tokens[i]:
                keep.append(b)
        if not keep:
            return rows
        if len(keep) < len(live):
            index = mx.array(keep)
            cache.set_arrays([a[index] for a in cache.state])
            token, pads, live = token[index], pads[index], [live[b] for b in keep]
        positions = mx.array([len(prompts[i]) + len(rows[i]) - 1 for i in live])[:, None]
        slots = mx.arange(cache.offset + 1, dtype=mx.int32)[None]  # (1, offset + 1)
        mask = additive_mask(slots >= pads, dtype)[:, None, None]  # (B, 1, 1, offset + 1)
        logits = model(token[:, None], cache, positions=positions, mask=mask).logits[:, -1]


def read_conversations(folder: Path) -> list[Conversation]:
    """The complete lines of `folder/data.jsonl` (a torn last line is dropped)."""
    file = folder / DATA_FILE
    if not file.exists():
        return []
    out = []
    for line in file.read_text().splitlines():
        try:
            row = json.loads(line)
            out.append(Conversation(tuple(row["tokens"]), int(row["answer"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # the line a killed run was writing
    return out


def data_key(
    model: CausalLM,
    tokenizer,
    *,
    prompts: Sequence[str | list[dict[str, str]]] = (),
    self_samples: int = 0,
    sample_prefix: int = 16,
    max_tokens: int = 200,
    temperature: float = 0.0,
    seed: int = 0,
    batch: int = 16,
) -> dict[str, Any]:
    """What `make_data` with these arguments builds its conversations from (keys.py): the
    target, the prompts as token ids (chat template applied), and the settings that change
    an answer. Seed and batch count only where something is drawn at random."""
    return _key(
        model,
        tokenizer,
        list(_inputs(tokenizer, prompts, self_samples)),
        self_samples,
        sample_prefix if self_samples else 0,
        max_tokens,
        temperature,
        seed,
        batch,
    )


def _key(
    model, tokenizer, inputs, self_samples, sample_prefix, max_tokens, temperature, seed, batch
) -> dict[str, Any]:
    drawn = sample_prefix > 0 or temperature > 0
    return {
        "model": model_identity(model),
        "inputs": None if self_samples else digest(inputs),
        "self_samples": self_samples,
        "sample_prefix": sample_prefix,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "eos": _eos(tokenizer),
        "seed": seed if drawn else None,
        "data_batch": batch if drawn else None,
    }


def make_data(
    model: CausalLM,
    tokenizer,
    folder: Path,
    *,
    prompts: Sequence[str | list[dict[str, str]]] = (),
    self_samples: int = 0,
    sample_prefix: int = 16,
    max_tokens: int = 200,
    temperature: float = 0.0,
    seed: int = 0,
    batch: int = 16,  # larger is faster, but self samples depend on the batch
    progress: bool = True,
) -> list[Conversation]:
    """Conversations for every prompt (or `self_samples` samples from BOS: `sample_prefix`
    tokens at T=1, then answered like a prompt), resuming after those already in `folder`
    when its key (`data_key`) matches, made afresh when it does not; `batch` prompts at a
    time are answered together."""
    if not prompts and self_samples <= 0:
        raise ValueError("give prompts, or self_samples > 0 for a model without a chat template")
    sample_prefix = sample_prefix if self_samples else 0
    if self_samples and sample_prefix == 0 and temperature == 0:
        raise ValueError("greedy self samples need a sampled prefix (sample_prefix > 0)")
    if prompts and not has_chat_template(tokenizer):
        raise ValueError(
            "the model has no chat template: train it on its own samples (--self-samples N)"
        )
    inputs = list(_inputs(tokenizer, prompts, self_samples))
    context = model.args.max_position_embeddings
    for i, ids in enumerate(inputs):
        if len(ids) + 1 >= context:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, the model's context is {context}")
    key = _key(
        model, tokenizer, inputs, self_samples, sample_prefix, max_tokens, temperature, seed, batch
    )
    old = read_key(folder / KEY_FILE)
    done = read_conversations(folder) if old == key else []
    if old is not None and old != key and progress:
        print(f"data: made from other settings ({differences(old, key)}): made again", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / KEY_FILE, key)
    file = folder / DATA_FILE
    with file.open("w") as f:  # rewrite the complete lines, dropping a torn one
        for c in done:
            f.write(json.dumps({"tokens": list(c.tokens), "answer": c.answer}) + "\n")
    sampling = SamplingParams(temperature=temperature)
    eos = _eos(tokenizer)
    from tqdm import tqdm

    bar = tqdm(total=len(inputs), initial=len(done), desc="data", disable=not progress)
    with file.open("a") as f:
        for i, n in _batches(inputs, len(done), batch, _windowed(model)):
            ids = inputs[i : i + n]
            key = mx.random.key(seed * 1_000_003 + i)
            if sample_prefix:  # self samples: varied starts, drawn at T=1, with no end token
                key, sub = mx.random.split(key)
                prefix = answer(model, ids, [sample_prefix] * n, [], SamplingParams(1.0), sub)
                ids = [p + q for p, q in zip(ids, prefix, strict=True)]
            room = [min(max_tokens, context - len(p)) for p in ids]
            for prompt, out in zip(ids, answer(model, ids, room, eos, sampling, key), strict=True):
                first = 1 if self_samples else len(prompt)  # all but BOS is the model's own
                done.append(Conversation(tuple(prompt) + tuple(out), first))
                f.write(json.dumps({"tokens": list(done[-1].tokens), "answer": first}) + "\n")
            f.flush()
            bar.update(n)
    bar.close()
    return done


def _eos(tokenizer) -> list[int]:
    return list(getattr(tokenizer, "eos_token_ids", None) or [])


def _windowed(model: CausalLM) -> bool:
    return model.args.sliding_window is not None and any(model.args.sliding_layers())


def _batches(
    inputs: list[list[int]], start: int, size: int, same_length: bool
) -> Iterator[tuple[int, int]]:
    """(first, count) of each batch from `start` on: `size` prompts (of one length when
    `same_length`)."""
    i = start
    while i < len(inputs):
        n = 1
        while (
            n < size
            and i + n < len(inputs)
            and (not same_length or len(inputs[i + n]) == len(inputs[i]))
        ):
            n += 1
        yield i, n
        i += n


def _inputs(tokenizer, prompts, self_samples: int) -> Iterator[list[int]]:
    if self_samples:
        bos = getattr(tokenizer, "bos_token_id", None)
        for _ in range(self_samples):
            yield [0 if bos is None else bos]
        return
    for prompt in prompts:
        yield apply_chat_template(tokenizer, prompt)
