"""Command-line flags for the speculative methods, shared by every CLI (generate, server)."""

from __future__ import annotations

import argparse
import re

from ..cli import bounded, non_negative_int, positive_int
from ..heads.medusa import DEFAULT_TREE, MEDUSA_TREES
from . import DrafterSpec, EagleTree, spec_from_keywords

# 0 is refused like the API does: it would build a drafter and never use it.
draft_tokens = bounded(int, lambda v: v >= 1, ">= 1 (plain decoding: give no speculative method)")
tree_total = bounded(int, lambda v: v >= 2, ">= 2 (the root and at least one draft)")

# spec_from_keywords' names -> these flags, so that its errors speak the CLI's words.
FLAGS = {
    "draft_model": "--draft-model",
    "prompt_lookup": "--prompt-lookup",
    "max_ngram": "--max-ngram",
    "medusa": "--medusa",
    "eagle": "--eagle",
    "tree": "--medusa-tree",
    "num_draft_tokens": "--num-draft-tokens",
    "typical_acceptance": "--typical-acceptance",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (lossless; one method at a time)")
    group.add_argument(
        "--draft-model",
        default=None,
        metavar="M",
        help="draft model folder or hub id (must share the model's tokenizer)",
    )
    group.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="draft by n-gram lookup in the prompt and output (no model needed)",
    )
    group.add_argument(
        "--max-ngram",
        type=positive_int,
        default=None,
        metavar="N",
        help="longest n-gram prompt lookup matches (default: 3)",
    )
    group.add_argument(
        "--medusa",
        nargs="?",
        const=True,
        default=False,
        metavar="DIR",
        help="draft trees with Medusa heads: those beside the model (its medusa/ folder), "
        "or the heads folder DIR",
    )
    group.add_argument(
        "--medusa-tree",
        choices=list(MEDUSA_TREES),
        default=None,
        help=f"Medusa tree (default: {DEFAULT_TREE})",
    )
    group.add_argument(
        "--eagle",
        nargs="?",
        const=True,
        default=False,
        metavar="DIR",
        help="draft dynamic trees with EAGLE-1/EAGLE-3 heads: those beside the model (its "
        "eagle/ folder), or the heads folder or hub id DIR (official or speculators layout)",
    )
    default = EagleTree()
    group.add_argument(
        "--tree-total",
        type=tree_total,
        default=None,
        metavar="N",
        help=f"EAGLE: most nodes verified per step, the root included (default {default.total})",
    )
    group.add_argument(
        "--tree-depth",
        type=non_negative_int,
        default=None,
        metavar="D",
        help=f"EAGLE: levels the tree grows per step (default {default.depth})",
    )
    group.add_argument(
        "--tree-top-k",
        type=positive_int,
        default=None,
        metavar="K",
        help=f"EAGLE: children per expanded node (default {default.top_k}; 1 drafts a chain)",
    )
    group.add_argument(
        "--num-draft-tokens",
        type=draft_tokens,
        default=None,
        metavar="K",
        help="tokens drafted per step (trees: nodes verified); default: chosen each step "
        "from measured costs and acceptance",
    )
    group.add_argument(
        "--typical-acceptance",
        action="store_true",
        help="Medusa's typical acceptance when sampling: faster but LOSSY (the output no "
        "longer follows the model's distribution)",
    )


def spec_from_args(args: argparse.Namespace) -> DrafterSpec | None:
    """The spec the flags ask for, or None for plain decoding; ValueError in the flags' words
    when they do not go together."""
    shape = {"total": args.tree_total, "depth": args.tree_depth, "top_k": args.tree_top_k}
    shape = {k: v for k, v in shape.items() if v is not None}
    if shape and not args.eagle:
        raise ValueError("--tree-total, --tree-depth and --tree-top-k apply to --eagle only")
    try:
        return spec_from_keywords(
            draft_model=args.draft_model,
            prompt_lookup=args.prompt_lookup,
            max_ngram=args.max_ngram,
            medusa=args.medusa,
            eagle=args.eagle,
            tree=args.medusa_tree or (EagleTree(**shape) if shape else None),
            num_draft_tokens=args.num_draft_tokens,
            typical_acceptance=args.typical_acceptance,
        )
    except ValueError as e:
        words = re.compile(r"\b(" + "|".join(FLAGS) + r")\b")
        raise ValueError(words.sub(lambda m: FLAGS[m[1]], str(e))) from None
