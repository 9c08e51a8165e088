"""The generation CLI: python -m mlx_speculate.generate --model M --prompt "..." [method]."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .chat import apply_chat_template
from .drafters import cli as drafter_cli
from .generation import GenerationResponse, stream_generate
from .sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_speculate.generate",
        description="Generate text with an MLX model, optionally with speculative decoding.",
    )
    parser.add_argument("--model", required=True, help="local folder or Hugging Face hub id")
    parser.add_argument("--prompt", default="-", help="prompt text, or - to read stdin")
    parser.add_argument("--max-tokens", "-m", type=int, default=256)
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument(
        "--ignore-chat-template", action="store_true", help="feed the prompt as raw text"
    )
    parser.add_argument("--verbose", action="store_true", help="print speed and statistics")
    drafter_cli.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .loading import load

    try:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        sampling = SamplingParams(args.temp, args.top_p, args.top_k, args.min_p, args.seed)
        spec = drafter_cli.spec_from_args(args)
        model, tokenizer = load(args.model)
        tokens = (
            list(tokenizer.encode(prompt))
            if args.ignore_chat_template
            else apply_chat_template(tokenizer, prompt, args.system_prompt)
        )
        response = None
        for response in stream_generate(
            model,
            tokenizer,
            tokens,
            max_tokens=args.max_tokens,
            sampling=sampling,
            stop=args.stop,
            drafter=spec,
        ):
            print(response.text, end="", flush=True)
        print()
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.verbose and response is not None:
        _print_stats(response)
    return 0


def _print_stats(response: GenerationResponse) -> None:
    print("=" * 10, file=sys.stderr)
    print(
        f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec\n"
        f"Generation: {response.generation_tokens} tokens, "
        f"{response.generation_tps:.1f} tokens-per-sec\n"
        f"Peak memory: {response.peak_memory:.3f} GB",
        file=sys.stderr,
    )
    stats = response.stats
    if stats is not None and stats.drafted:
        print(
            f"Speculation: {stats.accepted}/{stats.drafted} drafted tokens accepted "
            f"({stats.acceptance_rate:.1%}), {stats.tokens_per_forward:.2f} tokens per "
            f"target forward",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
