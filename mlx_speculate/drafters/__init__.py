"""Speculative methods: one file per method, each with its spec and its drafter.

    drafter = make_drafter(LookupSpec(max_ngram=3), target, tokenizer)

`make_drafter` validates that the method fits the target and returns a fresh `Drafter`; the
decoding loop, `stream_generate`, the CLI and the server all go through it. A new method is a
new module here with a `DrafterSpec` subclass (its keywords, flags and settings) and its
drafter, imported below: defining the spec registers it in `METHODS`, from which
`spec_from_keywords` and the CLI flags (`drafters/cli.py`) are resolved.
"""

from __future__ import annotations

from typing import Any

from ..models import needs_native
from ..models.base import CausalLM
from .assistant import AssistantSpec
from .base import MAX_DRAFT, METHODS, Draft, Drafter, DrafterSpec, TargetFeatures
from .dflash import DFlashSpec
from .draft_model import DraftModelSpec
from .eagle import EagleGrowth, EagleSpec
from .lookup import LookupSpec
from .medusa import MedusaSpec
from .mtp import MtpSpec

__all__ = [
    "AssistantSpec",
    "COMMON",
    "DFlashSpec",
    "MAX_DRAFT",
    "METHODS",
    "Draft",
    "DraftModelSpec",
    "Drafter",
    "DrafterSpec",
    "EagleSpec",
    "EagleGrowth",
    "LookupSpec",
    "MedusaSpec",
    "MtpSpec",
    "TargetFeatures",
    "make_drafter",
    "spec_from_keywords",
    "speculative_keywords",
]

COMMON = ("num_draft_tokens",)  # keywords every method takes


def make_drafter(spec: DrafterSpec, target: CausalLM, tokenizer=None) -> Drafter:
    """A fresh drafter for `target`, checked to fit it (ValueError otherwise)."""
    if not isinstance(spec, DrafterSpec):
        raise TypeError(f"expected a DrafterSpec, got {type(spec).__name__}")
    if not spec.logits_only and target.implementation != "native":
        raise ValueError(needs_native(spec.method, target.args.model_type))
    return spec.build(target, tokenizer)


def speculative_keywords() -> tuple[str, ...]:
    """Every `stream_generate` keyword some method owns, and those every method takes."""
    owned = dict.fromkeys(k for spec in METHODS.values() for k in spec.keywords)
    return (*owned, *COMMON)


def spec_from_keywords(**keywords: Any) -> DrafterSpec | None:
    """The spec that mlx-lm style keywords ask for (`draft_model=`, `prompt_lookup=True`,
    `medusa=`, `eagle=`, `mtp=`, `dflash=`, `assistant=`, each method's own options and
    `num_draft_tokens=`), or None when they ask for none. None and False mean "not given". A
    keyword no method owns is a TypeError; one that belongs to another method than the one
    chosen, a ValueError naming its owners."""
    owners: dict[str, list[str]] = {}
    for spec in METHODS.values():
        for keyword in spec.keywords:
            owners.setdefault(keyword, []).append(spec.selector())
    unknown = [k for k in keywords if k not in owners and k not in COMMON]
    if unknown:
        raise TypeError(
            f"unexpected keyword {unknown[0]!r} (speculative keywords: "
            f"{', '.join([*owners, *COMMON])})"
        )
    given = {k: v for k, v in keywords.items() if v is not None and v is not False}
    chosen = [spec for spec in METHODS.values() if spec.selector() in given]
    if len(chosen) > 1:
        raise ValueError(
            f"choose one speculative method, not {' and '.join(s.selector() for s in chosen)}"
        )
    method = chosen[0] if chosen else None
    for keyword in given:
        if keyword not in COMMON and (method is None or keyword not in method.keywords):
            raise ValueError(f"{keyword} applies to {' or '.join(owners[keyword])} only")
    common = {k: given[k] for k in COMMON if k in given}
    if method is None:
        if common:
            selectors = [spec.selector() for spec in METHODS.values()]
            raise ValueError(
                f"{' and '.join(common)} set, but such settings need a speculative method "
                f"({' or '.join(selectors)})"
            )
        return None
    own = {k: v for k, v in given.items() if k not in COMMON}
    return method.from_keywords(own, **common)
