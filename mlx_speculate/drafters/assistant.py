"""Gemma 4 assistant drafting (transformers' `SinglePositionMultiTokenCandidateGenerator`): a
`Gemma4AssistantForCausalLM` (heads/gemma4_assistant.py) drafts a chain of k tokens for a
Gemma 4 target, every step at the pending token's position P.

What it reads of the target: the keys and values of the target's last writing layer of each
type at every committed position, and the final-norm state at the last one. The keys are made
here, from the states entering those layers (taps), by the target layers' own input norm and
key/value projections (`gemma4.Attention.keys_values`), into a cache of the drafter's, slot =
position, as `extend` hands positions over; a rewind truncates it.

Step i reads [the target's scaled embedding of token i; state i]: token 0 is the pending one,
state 0 the target's final-norm state at P - 1. Its logits give token i + 1 (the argmax, or a
draw from the processed distribution when sampling, whose rows come back as `Draft.logprobs`,
so rejection sampling stays exact) and its projected output is state i + 1. The queries see
the target's keys at positions < P: what transformers' generation passes after the prompt and
after a chain accepted whole (after a partial one it also passes the keys of the rejected
draft at P, which are no committed position's; they are left out here).

One compiled graph per (k, sampling, attended span), whose inputs are P, the pending token,
the state and the cache's arrays: a proposal has no host sync.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..graphs import compiled
from ..heads.gemma4_assistant import Gemma4Assistant, load_assistant
from ..memo import from_folder
from ..models.base import CausalLM
from ..models.context import ForwardContext
from ..sampling import SamplingParams, pick
from ..tree import Tree
from .base import MAX_DRAFT, Draft, Drafter, DrafterSpec, TargetFeatures


@dataclass(frozen=True, kw_only=True, eq=False)
class AssistantSpec(DrafterSpec):
    """Chains drafted by a Gemma 4 assistant for a Gemma 4 target. `assistant`: the folder
    transformers saved it in (config.json with model_type `gemma4_assistant`, safetensors),
    or a `Gemma4Assistant`."""

    keywords: ClassVar[dict[str, str | None]] = {"assistant": "assistant"}
    flags: ClassVar[dict[str, str]] = {"assistant": "--assistant"}

    assistant: str | Path | Gemma4Assistant

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--assistant",
            default=None,
            metavar="DIR",
            help="draft chains with a Gemma 4 assistant (Gemma4AssistantForCausalLM, the "
            "transformers folder DIR) for a Gemma 4 target",
        )

    @classmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"assistant": args.assistant}

    def resolve(self, target: CausalLM) -> AssistantSpec:
        assistant = self.assistant
        if isinstance(assistant, Gemma4Assistant):
            return self
        if not isinstance(assistant, str | Path):
            raise ValueError(f"assistant must be a folder or a Gemma4Assistant, got {assistant!r}")
        loaded = from_folder(
            target, "assistant", assistant, lambda: load_assistant(assistant, target)
        )
        return replace(self, assistant=loaded)

    def build(self, target: CausalLM, tokenizer=None) -> AssistantDrafter:
        assistant = self.resolve(target).assistant
        return AssistantDrafter(assistant, target, self.num_draft_tokens or MAX_DRAFT)


class AssistantDrafter(Drafter):
    """Drafts chains at the pending position from the target's keys of every committed
    position (its own copy, per layer type) and its state at the last one."""

    follows_context = False

    def __init__(self, assistant: Gemma4Assistant, target: CausalLM, max_draft: int = MAX_DRAFT):
        self.sources = assistant.check_fits(target)  # layer type -> the target layer it reads
        self.taps = tuple(self.sources.values())
        self.assistant = assistant
        self.target = target
        self.max_draft = max_draft
        dtype = target.compute_dtype
        shapes = [target.args.kv_shape(p) for p in self.taps]
        self.cache = KVCache(len(shapes), like=[mx.zeros((1, h, 0, d), dtype) for h, d in shapes])
        self._last: mx.array | None = None  # (hidden,) target's state at slot offset - 1

    def weights(self) -> tuple[nn.Module, ...]:
        return (self.assistant,)

    def extend(self, features: TargetFeatures) -> None:
        n, start = features.hidden.shape[0], self.cache.offset
        slot = mx.array(start, mx.int32)
        ctx = ForwardContext(None, slot, None, None, start + n, None, None, ())
        for j, (layer, tap) in enumerate(zip(self.taps, features.taps, strict=True)):
            block = self.target.layers[layer]
            keys, values = block.self_attn.keys_values(block.input_layernorm(tap[None]), ctx)
            self.cache.write(j, keys, values, slot, start + n)
        self.cache.advance(n)
        self._last = features.hidden[-1]

    def rewind(self, length: int) -> None:
        if length < self.cache.offset:
            self.cache.truncate(length)
            self._last = None  # until `extend` brings the state at the new last position

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        committed = len(context) - 1
        k = min(k, self.max_draft)
        if k <= 0 or self.cache.offset != committed or self._last is None:
            return None
        span = self.cache.span(committed)
        sampling = replace(sampling, seed=None)  # the seed went into the generator already
        key = ("assistant", id(self.target), k, sampling)
        assistant, target, types = self.assistant, self.target, tuple(self.sources)

        def build() -> Callable:
            return _chain_fn(assistant, target, types, k, sampling, span)

        fn = compiled(assistant, key, build, traced=assistant.traceable, span=span)
        position, pending = mx.array(committed, mx.int32), mx.array(context[-1:], mx.int32)
        out = fn(position, pending, self._last, *self.cache.state)
        return Draft(out[0], Tree.chain(k), None if sampling.greedy else out[1])


def _chain_fn(
    assistant: Gemma4Assistant,
    target: CausalLM,
    types: tuple[str, ...],
    k: int,
    sampling: SamplingParams,
    span: int,
) -> Callable:
    """The chain's graph: (P, the pending token (1,), the target's state (hidden,), the
    cache's keys then values, one per layer type in `types`) -> (the k tokens, [their (k, V)
    processed log-probabilities when sampling])."""
    layers = len(types)

    def fn(position, pending, state, *arrays):
        keys, values = arrays[:layers], arrays[layers:]
        kv = {t: (keys[j][..., :span, :], values[j][..., :span, :]) for j, t in enumerate(types)}
        seq_len = assistant.args.text.max_position_embeddings
        if not assistant.traceable:  # untraced: the host may read the position
            seq_len = int(position.item()) + 1
        ctx = assistant.context(position, kv, seq_len)  # one rotation for every step
        token, state = pending, state.reshape(1, 1, -1)
        tokens, rows = [], []
        for _ in range(k):
            inputs = mx.concatenate([target.model.embed(token[None]), state], axis=-1)
            logits, state = assistant(inputs, ctx)  # (1, 1, V), (1, 1, hidden)
            token, logprobs = pick(logits[0, 0].astype(mx.float32), sampling)
            token = token.reshape(1)
            tokens.append(token)
            rows.append(logprobs)
        drafted = mx.concatenate(tokens)
        return (drafted,) if sampling.greedy else (drafted, mx.stack(rows))

    return fn
