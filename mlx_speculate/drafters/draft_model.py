"""A smaller model of the same vocabulary drafts a chain autoregressively with its own cache."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..loading import token_count
from ..memo import from_folder
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..step import decode, decode_at
from ..tree import Tree
from .base import MAX_DRAFT, Draft, DrafterSpec, PipelinedDrafter, TargetFeatures

# Texts whose ids must agree between the two tokenizers: words, spacing, digits, punctuation,
# code, and characters that fall back to bytes in small vocabularies.
PROBES = (
    "Hello, world!",
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "The year 2024: 3.14159 * 42 = 131.95",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment",
    "naïve café, Grüße, 東京, emoji 🙂",
    "UPPER lower MiXeD snake_case kebab-case CamelCase",
)


def check_vocabularies(
    target_vocab_size: int,
    draft_vocab_size: int,
    target_tokenizer=None,
    draft_tokenizer=None,
) -> int:
    """The vocabulary range both models share; raises ValueError when they cannot share one.

    Sizes may differ only by padding (e.g. 151,936 vs 152,064 for Qwen): every id the target's
    tokenizer can produce must then lie inside both models. A draft tokenizer, when given, must
    give the same ids for the same text and the same special tokens.
    """
    shared = min(target_vocab_size, draft_vocab_size)
    if draft_tokenizer is not None and target_tokenizer is not None:
        for name in ("bos_token_id", "eos_token_id"):
            a, b = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
            if a != b:
                raise ValueError(
                    f"draft tokenizer's {name} {b} does not match the target's {a} "
                    f"(vocabularies: draft {draft_vocab_size}, target {target_vocab_size})"
                )
        for text in PROBES:
            a = list(target_tokenizer.encode(text, add_special_tokens=False))
            b = list(draft_tokenizer.encode(text, add_special_tokens=False))
            if a != b:
                raise ValueError(
                    f"draft tokenizer (vocabulary {draft_vocab_size}) does not encode {text!r} "
                    f"like the target's (vocabulary {target_vocab_size}): {b} vs {a}"
                )
    if target_vocab_size == draft_vocab_size:
        return shared
    used = None if target_tokenizer is None else token_count(target_tokenizer)
    if draft_tokenizer is not None:
        used = max(used or 0, token_count(draft_tokenizer))
    if used is None or used > shared:
        raise ValueError(
            f"draft vocabulary {draft_vocab_size} does not match target {target_vocab_size}"
            + ("" if used is None else f" (the tokenizer uses {used} ids)")
        )
    return shared


@dataclass(frozen=True, kw_only=True, eq=False)
class DraftModelSpec(DrafterSpec):
    """Speculation with a draft model: a loaded model or its folder / hub id. Its tokenizer
    (given, or the one `load` gave it) must agree with the target's."""

    keywords: ClassVar[dict[str, str | None]] = {
        "draft_model": "model",
        "draft_tokenizer": "tokenizer",
    }
    flags: ClassVar[dict[str, str]] = {"draft_model": "--draft-model"}
    logits_only: ClassVar[bool] = True

    model: CausalLM | str | Path
    tokenizer: Any = None

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--draft-model",
            default=None,
            metavar="M",
            help="draft model folder or hub id (must share the model's tokenizer)",
        )

    @classmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"draft_model": args.draft_model}

    def resolve(self, target: CausalLM) -> DraftModelSpec:
        if not isinstance(self.model, str | Path):
            return self
        from ..loading import load

        model, loaded = from_folder(target, "draft", self.model, lambda: load(self.model))
        return replace(self, model=model, tokenizer=self.tokenizer or loaded)

    def build(self, target: CausalLM, tokenizer=None) -> DraftModelDrafter:
        spec = self.resolve(target)
        model, draft_tokenizer = spec.model, spec.tokenizer
        if model.recurrent:  # its cache restarts and rewinds past what a HybridCache keeps
            raise ValueError(
                f"a {model.args.model_type} draft model is not supported (recurrent layers): "
                "use a draft model with attention layers only"
            )
        check_vocabularies(
            target.args.vocab_size,
            model.args.vocab_size,
            tokenizer or target.origin.tokenizer,
            draft_tokenizer or model.origin.tokenizer,
        )
        return DraftModelDrafter(
            model, target.args.vocab_size, max_draft=self.num_draft_tokens or MAX_DRAFT
        )


class DraftModelDrafter(PipelinedDrafter):
    """Proposes k tokens by running `model` autoregressively: lazy, so the whole draft joins the
    target's verify forward in the loop's one evaluation.

    The cache holds the context up to some point; each proposal first feeds, in one forward,
    every context token not yet in it (the last context token is always among them), so no
    token is run twice. After plain steps the draft may lag far behind: when more than
    `max_catch_up` tokens are missing (or its own context would overflow), it restarts on the
    first `SINK` context tokens and the last `max_catch_up`, StreamingLLM-style, since catching
    up costs a forward over every skipped token. Only ids below `min(draft, target vocabulary)`
    are proposed.
    """

    taps: tuple[int, ...] = ()
    SINK = 4  # leading tokens kept on a restart: attention leans on them

    follows_context = True

    def __init__(
        self,
        model: CausalLM,
        target_vocab_size: int,
        max_draft: int = MAX_DRAFT,
        max_catch_up: int = 32,
    ):
        self.model = model
        self.cache = model.make_cache()
        self.max_draft = max_draft
        self.target_vocab_size = target_vocab_size
        self.shared = min(model.args.vocab_size, target_vocab_size)
        self.max_catch_up = max_catch_up
        # The cache holds context[:SINK] and then context[SINK + skipped : offset + skipped].
        self.skipped = 0
        # The last chain: the cache slot of its first token and its length (for `follow`).
        self._chain: tuple[int, int] | None = None
        # A chain `follow` queued, whose start waits on the count of the one before: (that
        # one's first slot and length, this one's length), resolved by the next `rewind`.
        self._queued: tuple[int, int, int] | None = None

    def weights(self) -> tuple[nn.Module, ...]:
        return (self.model,)

    def extend(self, features: TargetFeatures) -> None:
        pass  # it reads tokens, not the target's features

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        k = min(k, self.max_draft)
        if k <= 0:
            return None
        # The last context token is pending: never in the cache yet.
        self.rewind(len(context) - 1)
        offset = self.cache.offset
        behind = len(context) - offset - self.skipped
        overflow = offset + behind + k > self.model.args.max_position_embeddings
        if overflow or (offset > 0 and behind > self.max_catch_up):
            offset = self._truncate(min(offset, self.SINK))
            self.skipped = max(len(context) - self.max_catch_up - self.SINK, 0)
        fresh = list(context[offset : self.SINK]) + list(
            context[max(offset, self.SINK) + self.skipped :]
        )
        # Ids beyond the shared range are clipped: a worse guess, never a wrong output.
        inputs = mx.array([min(t, self.shared - 1) for t in fresh], dtype=mx.int32)
        # One compiled graph per row bucket and k: no host sync, no offset-dependent shape.
        tokens, logprobs = decode(
            self.model, self.cache, inputs, k, sampling, self.shared, self.target_vocab_size
        )
        self._chain = (self.cache.offset - (k - 1), k)
        return Draft(tokens, Tree.chain(k), logprobs)

    def follow(
        self,
        drafted: mx.array,
        accepted: mx.array,
        pending: mx.array,
        k: int,
        sampling: SamplingParams,
    ) -> Draft | None:
        """The next chain, queued while the last one (`drafted`, its tokens) is verified: lazy
        in the count of them the target `accepted` (an int32 scalar) and in the `pending`
        token (1,) it chose after them. The cache holds the last chain's first k - 1 tokens
        from its first slot p: after n accepted, the next chain feeds the pending token at
        p + n (and the last draft before it when all k were accepted). None when the chain
        could overflow the model's positions or the draft cannot be traced: `propose` then runs
        once the count is read. The next `rewind` settles the host offset."""
        k = min(k, self.max_draft)
        last = self._chain
        if k <= 0 or last is None or self._queued is not None or not self.model.traceable:
            return None
        first, length = last
        if first + length + k > self.model.args.max_position_embeddings:
            return None
        full = accepted == length
        pending = mx.minimum(pending.astype(mx.int32), self.shared - 1)
        inputs = mx.where(
            full,
            mx.concatenate([mx.minimum(drafted[-1:], self.shared - 1), pending]),
            mx.concatenate([pending, mx.zeros((1,), mx.int32)]),
        )  # (2,): one row bucket
        start = first + mx.minimum(accepted, length - 1)
        tokens, logprobs = decode_at(
            self.model,
            self.cache,
            inputs,
            full.astype(mx.int32),
            (start, first + length - 1),
            k,
            sampling,
            self.shared,
            self.target_vocab_size,
        )
        self._queued = (first, length, k)
        return Draft(tokens, Tree.chain(k), logprobs)

    def settle(self, accepted: int) -> None:
        """The target accepted `accepted` tokens of the chain before the one `follow` queued:
        the committed context ends at that chain's first slot + `accepted`; past it the pending
        token and the queued chain's first k - 1 tokens wait on their verify (the offset stays
        at the committed end, as after `rewind`)."""
        first, _, k = self._queued
        self._queued = None
        self.cache.truncate(min(self.cache.offset, first))
        self.cache.advance(first + accepted - self.cache.offset)
        self._chain = (first + accepted + 1, k)

    def rewind(self, length: int) -> None:
        if self._queued is not None:  # a queued chain nobody settled wrote from its first slot
            self.cache.truncate(min(self.cache.offset, self._queued[0]))
            self._queued = None
        self._chain = None
        if length >= self.SINK + self.skipped:
            self._truncate(min(self.cache.offset, length - self.skipped))
        else:  # only a reset reaches back into the skipped stretch
            self._truncate(min(self.cache.offset, length, self.SINK))
            self.skipped = 0

    def _truncate(self, length: int) -> int:
        """Truncates the draft's cache to `length` slots, or where a draft whose sliding layers
        are rings (cache.py) can no longer return there, empties it, to catch up from the
        start (`propose`); returns the slots kept."""
        kept = self.cache.restorable(length)
        self.cache.truncate(kept)
        if kept == 0:
            self.skipped = 0
        return kept
