"""python -m mlx_speculate.train {eagle1,eagle3,medusa,dflash} --model M --prompts FILE --out DIR"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from .. import cli
from ..cli import INTERRUPTED, fail, prog
from .options import add_options, given
from .recipe import train_head
from .settings import KINDS, TRAINING, Recipe, TrainConfig


def parser() -> argparse.ArgumentParser:
    """The flags of `Recipe` and `TrainConfig` (their fields: options.py), and where to read
    and write."""
    p = cli.ArgumentParser(
        prog=prog("mlx_speculate.train"),
        description="Train a draft head from the target's own answers (resumable: run the "
        "same command again after a stop).",
    )
    p.add_argument(
        "kind",
        choices=KINDS,
        help="the head: EAGLE-1, EAGLE-3 (taps several layers, own draft vocabulary), Medusa "
        "or a DFlash block drafter",
    )
    p.add_argument("--model", required=True, help="the target: a model folder or hub id")
    p.add_argument("--prompts", help="JSON/JSONL: strings, ShareGPT or `messages` items")
    p.add_argument("--out", required=True, help="a new folder for the head (official layout)")
    p.add_argument("--cache", help="where stages are cached (default: OUT.cache)")
    add_options(p, Recipe)
    add_options(p, TrainConfig, TRAINING)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:  # only the flags given replace the kind's defaults
        changes, train_changes = given(args, Recipe, args.kind), given(args, TrainConfig, args.kind)
    except ValueError as e:  # a flag of another kind's
        p.error(str(e))
    try:
        base = Recipe(args.kind)
        recipe = replace(base, **changes, train=replace(base.train, **train_changes))
        result = train_head(
            args.kind,
            args.model,
            args.out,
            prompts=args.prompts,
            cache=args.cache,
            recipe=recipe,
            progress=not args.quiet,
        )
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, OSError) as e:
        return fail(e)
    times = ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items())
    print(
        f"wrote {result.out}: held-out top-1 {result.held_out_top1:.1%} ({times}; "
        f"{result.tokens} tokens, {result.bytes_per_token:.0f} bytes a token cached)"
    )
    for stage, peak in result.peaks.items():
        print(f"  {stage}: {peak.describe()}")
    print(result.payoff.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
