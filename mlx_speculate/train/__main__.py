"""python -m mlx_speculate.train {eagle1,eagle3,medusa,dflash} --model M --prompts FILE --out DIR"""

from __future__ import annotations

import argparse
import sys

from .. import cli
from ..cli import INTERRUPTED, fail, non_negative_float, non_negative_int, positive_int, prog
from ..heads.eagle_format import LAYOUTS
from .loop import TrainConfig
from .recipe import DRAFT_VOCAB, KINDS, Recipe, train_head


def parser() -> argparse.ArgumentParser:
    """The flags of `Recipe` and `TrainConfig`, with their defaults."""
    p = cli.ArgumentParser(
        prog=prog("mlx_speculate.train"),
        description="Train a draft head from the target's own answers (resumable: run the "
        "same command again after a stop).",
    )
    p.add_argument(
        "kind",
        choices=KINDS,
        help="the head: EAGLE-1, EAGLE-3 (taps several layers, own draft vocabulary) or Medusa",
    )
    p.add_argument("--model", required=True, help="the target: a model folder or hub id")
    p.add_argument("--prompts", help="JSON/JSONL: strings, ShareGPT or `messages` items")
    p.add_argument(
        "--self-samples",
        type=positive_int,
        default=0,
        help="train on N samples from BOS (models without a chat template)",
    )
    p.add_argument(
        "--sample-prefix",
        type=non_negative_int,
        default=Recipe.sample_prefix,
        help="self samples: tokens drawn at T=1 before answering (default: %(default)s)",
    )
    p.add_argument("--out", required=True, help="a new folder for the head (official layout)")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=Recipe.layout,
        help="EAGLE-3: SafeAILab's keys or vllm-project/speculators' (default: %(default)s)",
    )
    p.add_argument("--cache", help="where stages are cached (default: OUT.cache)")
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=Recipe.max_tokens,
        help="answer length (default: %(default)s)",
    )
    p.add_argument("--temperature", type=non_negative_float, default=Recipe.temperature,
                   help="the target's answers: 0 greedy, else sampled (default: %(default)s)")
    p.add_argument(
        "--data-batch",
        type=positive_int,
        default=Recipe.data_batch,
        help="prompts answered together (default: %(default)s; 32 is faster; "
        "self samples depend on it)",
    )
    p.add_argument(
        "--top-k",
        type=positive_int,
        default=Recipe.top_k,
        help="target logits kept a token, the distribution the losses match (default: %(default)s)",
    )
    p.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=Recipe.draft_vocab,
        help=f"EAGLE-3: the most frequent answer tokens the head predicts, at most "
        f"the target's vocabulary (default: {DRAFT_VOCAB}, or the whole vocabulary "
        "where smaller)",
    )
    p.add_argument(
        "--taps",
        type=int,
        nargs="+",
        help="EAGLE-3: the target layers whose input states it reads (default: 2, L//2 and "
        "L-3); DFlash: the layers whose outputs it reads (default: z-lab's spread)",
    )
    p.add_argument(
        "--ttt-steps",
        type=positive_int,
        default=Recipe.ttt_steps,
        help="EAGLE-3: draft steps unrolled in training (training-time test; default: %(default)s)",
    )
    p.add_argument(
        "--intermediate-size",
        type=positive_int,
        help="EAGLE: the draft layer's MLP width (default: the target's)",
    )
    p.add_argument("--medusa-heads", type=positive_int, default=Recipe.medusa_heads,
                   help="Medusa: heads, one per future token (default: %(default)s)")
    p.add_argument("--medusa-layers", type=positive_int, default=Recipe.medusa_layers,
                   help="Medusa: residual blocks a head (default: %(default)s)")
    p.add_argument("--block-size", type=positive_int,
                   help=f"DFlash: tokens a block, the verified one included "
                   f"(default: {Recipe.block_size})")
    p.add_argument("--draft-layers", type=positive_int,
                   help=f"DFlash: the drafter's decoder layers (default: {Recipe.draft_layers})")
    p.add_argument("--anchors", type=positive_int,
                   help=f"DFlash: blocks a conversation a step at most, anchored at random answer "
                   f"tokens (default: {Recipe.anchors})")
    p.add_argument("--epochs", type=positive_int, default=TrainConfig.epochs,
                   help="passes over the data at most (default: %(default)s)")
    p.add_argument(
        "--lr",
        type=non_negative_float,
        default=TrainConfig.learning_rate,
        help="AdamW's peak learning rate, after warmup, then cosine decay (default: %(default)s)",
    )
    p.add_argument("--warmup", type=positive_int, default=TrainConfig.warmup,
                   help="steps of linear warmup (default: %(default)s)")
    p.add_argument("--batch-tokens", type=positive_int, default=TrainConfig.batch_tokens,
                   help="padded tokens a training step (default: %(default)s)")
    p.add_argument(
        "--holdout",
        type=non_negative_float,
        default=TrainConfig.holdout,
        help="share of conversations held out to measure top-1 accuracy (default: %(default)s)",
    )
    p.add_argument(
        "--patience",
        type=positive_int,
        default=TrainConfig.patience,
        help="epochs without a better held-out accuracy before stopping (default: %(default)s)",
    )
    p.add_argument("--max-steps", type=positive_int,
                   help="stop after this many steps in all, with a checkpoint")
    p.add_argument(
        "--seed",
        type=int,
        default=TrainConfig.seed,
        help="the split, the shuffles, the initialisation and the noise (default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.kind != "eagle3" and args.draft_vocab is not None:
        p.error(f"--draft-vocab applies to eagle3, not {args.kind}")
    if args.kind not in ("eagle3", "dflash") and args.taps is not None:
        p.error(f"--taps applies to eagle3 and dflash, not {args.kind}")
    dflash_only = (
        ("--block-size", args.block_size),
        ("--draft-layers", args.draft_layers),
        ("--anchors", args.anchors),
    )
    for flag, value in dflash_only:
        if args.kind != "dflash" and value is not None:
            p.error(f"{flag} applies to dflash, not {args.kind}")
    try:
        config = TrainConfig(
            epochs=args.epochs,
            learning_rate=args.lr,
            warmup=args.warmup,
            batch_tokens=args.batch_tokens,
            holdout=args.holdout,
            patience=args.patience,
            max_steps=args.max_steps,
            seed=args.seed,
        )
        recipe = Recipe(
            args.kind,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            self_samples=args.self_samples,
            sample_prefix=args.sample_prefix,
            top_k=args.top_k,
            data_batch=args.data_batch,
            draft_vocab=args.draft_vocab,
            taps=None if args.taps is None else tuple(args.taps),
            ttt_steps=args.ttt_steps,
            intermediate_size=args.intermediate_size,
            medusa_heads=args.medusa_heads,
            medusa_layers=args.medusa_layers,
            block_size=args.block_size or Recipe.block_size,
            draft_layers=args.draft_layers or Recipe.draft_layers,
            anchors=args.anchors or Recipe.anchors,
            layout=args.layout,
            train=config,
        )
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
