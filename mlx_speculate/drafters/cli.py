"""Command-line flags for the speculative methods, shared by every CLI (generate, server): each
method's spec adds its own flags and turns them back into `stream_generate` keywords, so a flag
and its keyword resolve in one place (`spec_from_keywords`)."""

from __future__ import annotations

import argparse
import re

from ..cli import bounded
from . import COMMON, METHODS, DrafterSpec, spec_from_keywords

# 0 is refused like the API does: it would build a drafter and never use it.
draft_tokens = bounded(int, lambda v: v >= 1, ">= 1 (plain decoding: give no speculative method)")

COMMON_FLAGS = {"num_draft_tokens": "--num-draft-tokens"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (lossless; one method at a time)")
    for spec in METHODS.values():
        spec.add_arguments(group)
    group.add_argument(
        "--num-draft-tokens",
        type=draft_tokens,
        default=None,
        metavar="K",
        help="tokens drafted per step (trees: nodes verified); default: chosen each step "
        "from measured costs and acceptance",
    )


def flags() -> dict[str, str]:
    """Every keyword's flag(s), the methods' own and the common ones."""
    names = dict(COMMON_FLAGS)
    for spec in METHODS.values():
        names.update(spec.flags)
    return names


def spec_from_args(args: argparse.Namespace) -> DrafterSpec | None:
    """The spec the flags ask for, or None for plain decoding; ValueError in the flags' words
    when they do not go together."""
    keywords = {k: getattr(args, k) for k in COMMON}
    for spec in METHODS.values():
        keywords.update(spec.keywords_from_args(args))
    try:
        return spec_from_keywords(**keywords)
    except ValueError as e:
        names = flags()
        words = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
        raise ValueError(words.sub(lambda m: names[m[1]], str(e))) from None
