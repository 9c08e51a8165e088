"""Stage 1, data: conversations the target wrote itself, cached on disk and resumable.

Prompts come from a JSON or JSONL file: a list of strings, or conversations in ShareGPT
(`{"conversations": [{"from": "human", "value": ...}]}`) or OpenAI (`{"messages": [...]}`)
form, whose turns up to the first assistant turn are the prompt. The target answers each with
its chat template (greedy; `temperature` > 0 samples instead). A model without a chat template
(the TinyStories models) writes its own samples from BOS instead (`self_samples`).

`data.jsonl` holds one conversation a line, `{"tokens": [...], "answer": i}` (tokens from i on
are the target's own), appended and flushed one at a time; a killed run resumes after the last
complete line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..chat import apply_chat_template, has_chat_template
from ..models.base import CausalLM
from ..sampling import SamplingParams, pick

DATA_FILE = "data.jsonl"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "system": "system"}  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    tokens: tuple[int, ...]
    answer: int  # index of the first token the target wrote


def read_prompts(path: str | Path) -> list[str | list[dict[str, str]]]:
    """Prompts (a user message, or the messages before the first assistant turn) from `path`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the prompt file {path}: {e}") from None
    try:
        if path.suffix == ".jsonl":
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            items = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as e:
        raise ValueError(f"the prompt file {path} is not valid JSON: {e}") from None
    if isinstance(items, dict):  # {"prompts": [...]} and the like
        items = next((v for v in items.values() if isinstance(v, list)), [])
    if not isinstance(items, list) or not items:
        raise ValueError(f"the prompt file {path} holds no prompts")
    return [_prompt(item, i, path) for i, item in enumerate(items)]


def _prompt(item: Any, index: int, path: Path) -> str | list[dict[str, str]]:
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
        raise ValueError(
            f"prompt {index} in {path} is neither text nor a conversation: {item!r}"[:200]
        )
    return messages


def answer(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    eos: Sequence[int],
    sampling: SamplingParams,
    key: mx.array,
) -> list[list[int]]:
    """The target's own continuations of equal-length `prompts`, in one batch (greedy unless
    `sampling` says otherwise), each up to and including its first end token. One sync per
    token: it stops when every row has ended."""
    cache = model.make_cache()
    logits = model(mx.array([list(p) for p in prompts]), cache).logits[:, -1]  # (B, V)
    rows: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    for _ in range(max_tokens):
        key, sub = mx.random.split(key)
        token, _ = pick(logits, sampling, sub)  # (B,)
        for b, t in enumerate(token.tolist()):
            if not ended[b]:
                rows[b].append(t)
                ended[b] = t in eos
        if all(ended):
            break
        logits = model(token[:, None], cache).logits[:, -1]
    return rows


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


def make_data(
    model: CausalLM,
    tokenizer,
    folder: Path,
    *,
    prompts: Sequence[str | list[dict[str, str]]] = (),
    self_samples: int = 0,
    max_tokens: int = 200,
    temperature: float = 0.0,
    seed: int = 0,
    batch: int = 16,
    progress: bool = True,
) -> list[Conversation]:
    """Conversations for every prompt (or `self_samples` samples from BOS), resuming after
    those already in `folder`; up to `batch` prompts of one length are answered at once."""
    if not prompts and self_samples <= 0:
        raise ValueError("give prompts, or self_samples > 0 for a model without a chat template")
    if prompts and not has_chat_template(tokenizer):
        raise ValueError(
            "the model has no chat template: train it on its own samples (--self-samples N)"
        )
    inputs = list(_inputs(tokenizer, prompts, self_samples))
    context = model.args.max_position_embeddings
    for i, ids in enumerate(inputs):
        if len(ids) + 1 >= context:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, the model's context is {context}")
    done = read_conversations(folder)
    file = folder / DATA_FILE
    with file.open("w") as f:  # rewrite the complete lines, dropping a torn one
        for c in done:
            f.write(json.dumps({"tokens": list(c.tokens), "answer": c.answer}) + "\n")
    sampling = SamplingParams(temperature=1.0 if self_samples else temperature)
    eos = list(getattr(tokenizer, "eos_token_ids", None) or [])
    from tqdm import tqdm

    bar = tqdm(total=len(inputs), initial=len(done), desc="data", disable=not progress)
    with file.open("a") as f:
        i = len(done)
        while i < len(inputs):
            # A batch of the next prompts of one length (all of them, for samples from BOS).
            n = next((j for j in range(1, batch) if i + j >= len(inputs)
                      or len(inputs[i + j]) != len(inputs[i])), batch)  # fmt: skip
            ids = inputs[i : i + n]
            room = min(max_tokens, context - len(ids[0]))
            key = mx.random.key(seed * 1_000_003 + i)
            for prompt, out in zip(ids, answer(model, ids, room, eos, sampling, key), strict=True):
                done.append(Conversation(tuple(prompt) + tuple(out), len(prompt)))
                f.write(json.dumps({"tokens": list(done[-1].tokens), "answer": len(prompt)}) + "\n")
            f.flush()
            bar.update(n)
            i += n
    bar.close()
    return done


def _inputs(tokenizer, prompts, self_samples: int) -> Iterator[list[int]]:
    if self_samples:
        bos = getattr(tokenizer, "bos_token_id", None)
        for _ in range(self_samples):
            yield [0 if bos is None else bos]
        return
    for prompt in prompts:
        yield apply_chat_template(tokenizer, prompt)
