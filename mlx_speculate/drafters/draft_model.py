"""A smaller model of the same vocabulary drafts a chain autoregressively with its own cache."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx

from ..loading import token_count
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..step import decode
from ..tree import Tree
from .base import MAX_DRAFT, Draft, DrafterSpec, TargetFeatures

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

        model, loaded = load(self.model)
        return replace(self, model=model, tokenizer=self.tokenizer or loaded)

    def build(self, target: CausalLM, tokenizer=None) -> DraftModelDrafter:
        spec = self.resolve(target)
        model, draft_tokenizer = spec.model, spec.tokenizer
        check_vocabularies(
            target.args.vocab_size,
            model.args.vocab_size,
            tokenizer or target.origin.tokenizer,
            draft_tokenizer or model.origin.tokenizer,
        )
        return DraftModelDrafter(
            model, target.args.vocab_size, max_draft=self.num_draft_tokens or MAX_DRAFT
        )


class DraftModelDrafter:
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
            self.cache.truncate(offset := min(offset, self.SINK))
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
        return Draft(tokens, Tree.chain(k), logprobs)

    def rewind(self, length: int) -> None:
        if length >= self.SINK + self.skipped:
            self.cache.truncate(min(self.cache.offset, length - self.skipped))
        else:  # only a reset reaches back into the skipped stretch
            self.cache.truncate(min(self.cache.offset, length, self.SINK))
            self.skipped = 0
