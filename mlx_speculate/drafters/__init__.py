"""Speculative methods: one file per method, each with its spec and its drafter.

    drafter = make_drafter(LookupSpec(max_ngram=3), target, tokenizer)

`make_drafter` validates that the method fits the target and returns a fresh `Drafter`; the
decoding loop, `stream_generate`, the CLI and the server all go through it. A new method is a
new module here with a `DrafterSpec` subclass and its drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models.base import CausalLM
from .base import MAX_DRAFT, Draft, Drafter, DrafterSpec, TargetFeatures
from .draft_model import DraftModelSpec
from .eagle import EagleSpec, EagleTree
from .lookup import LookupSpec
from .medusa import MedusaSpec

__all__ = [
    "MAX_DRAFT",
    "Draft",
    "DraftModelSpec",
    "Drafter",
    "DrafterSpec",
    "EagleSpec",
    "EagleTree",
    "LookupSpec",
    "MedusaSpec",
    "TargetFeatures",
    "make_drafter",
    "spec_from_keywords",
]


def make_drafter(spec: DrafterSpec, target: CausalLM, tokenizer=None) -> Drafter:
    """A fresh drafter for `target`, checked to fit it (ValueError otherwise)."""
    if not isinstance(spec, DrafterSpec):
        raise TypeError(f"expected a DrafterSpec, got {type(spec).__name__}")
    return spec.build(target, tokenizer)


def spec_from_keywords(
    *,
    draft_model: CausalLM | str | Path | None = None,
    draft_tokenizer: Any = None,
    prompt_lookup: bool = False,
    max_ngram: int | None = None,
    medusa: Any = None,
    eagle: Any = None,
    tree: Any = None,
    num_draft_tokens: int | None = None,
    typical_acceptance: bool = False,
) -> DrafterSpec | None:
    """The spec that mlx-lm style keywords ask for (`draft_model=`, `prompt_lookup=True`,
    `medusa=`, `eagle=`), or None when they ask for none."""
    chosen = {
        "draft_model": draft_model is not None,
        "prompt_lookup": bool(prompt_lookup),
        "medusa": medusa is not None and medusa is not False,
        "eagle": eagle is not None and eagle is not False,
    }
    names = [name for name, on in chosen.items() if on]
    if len(names) > 1:
        raise ValueError(f"choose one speculative method, not {' and '.join(names)}")
    common = {"num_draft_tokens": num_draft_tokens, "typical_acceptance": typical_acceptance}
    for option, value, methods in (
        ("draft_tokenizer", draft_tokenizer, ("draft_model",)),
        ("max_ngram", max_ngram, ("prompt_lookup",)),
        ("tree", tree, ("medusa", "eagle")),
    ):
        if value is not None and not set(names) & set(methods):
            raise ValueError(f"{option} applies to {' or '.join(methods)} only")
    if not names:
        given = [name for name, value in common.items() if value not in (None, False)]
        if given:
            raise ValueError(
                f"{' and '.join(given)} set, but such settings need a speculative method "
                f"({' or '.join(chosen)})"
            )
        return None
    if names == ["draft_model"]:
        return DraftModelSpec(model=draft_model, tokenizer=draft_tokenizer, **common)
    if names == ["prompt_lookup"]:
        return LookupSpec(**({} if max_ngram is None else {"max_ngram": max_ngram}), **common)
    if names == ["eagle"]:
        return EagleSpec(heads=eagle, **({} if tree is None else {"tree": tree}), **common)
    return MedusaSpec(heads=medusa, tree=tree, **common)
