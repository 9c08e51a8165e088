"""The target's own continuations of prompts: what heads are trained to predict."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..models.base import CausalLM
from ..sampling import SamplingParams, pick


def rollout(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    length: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[tuple[mx.array, mx.array]]:
    """`length` tokens of the model's own after each group of equal-length prompts (batched).

    Returns per group (hidden, generated): (B, length, hidden) final hidden states at the
    positions from the last prompt token on, and the (B, length) tokens they chose, so
    hidden[:, i] is followed by generated[:, i], generated[:, i + 1], ...
    """
    sampling = SamplingParams(temperature=temperature)
    key = mx.random.key(seed)
    groups: dict[int, list[Sequence[int]]] = {}
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        groups.setdefault(len(prompt), []).append(prompt)
    out = []
    for members in groups.values():
        cache = model.make_cache()
        step = model(mx.array([list(p) for p in members]), cache)  # (B, P) prompts
        hidden, generated = [], []
        for _ in range(length):
            key, sub = mx.random.split(key)
            token, _ = pick(step.logits[:, -1], sampling, sub)  # (B,)
            hidden.append(step.hidden[:, -1].astype(mx.float32))
            generated.append(token)
            step = model(token[:, None], cache)
            mx.eval(token, hidden[-1], cache.state)
        out.append((mx.stack(hidden, axis=1), mx.stack(generated, axis=1)))
    return out


def sampled_prompts(
    model: CausalLM, start: Sequence[int], count: int, length: int, seed: int = 0
) -> list[list[int]]:
    """`count` varied prompts: `start` followed by `length` tokens the model samples at T=1."""
    ((_, generated),) = rollout(model, [list(start)] * count, length, 1.0, seed)
    return [list(start) + row for row in generated.tolist()]
