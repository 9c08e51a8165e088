"""The prompt-cache CLI: python -m mlx_speculate.cache_prompt --prompt-cache-file F --prompt ...

Prefills a prompt once and saves its cache (prompt_cache/), for `generate --prompt-cache-file F
--prompt "..."` to continue: mlx-lm's cache_prompt, with its flags.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import cli
from .chat import open_user_message
from .default_model import load_or_default
from .loading import DTYPES
from .prompt_cache import cache_prompt, save_prompt_cache

EXAMPLES = """examples:
  %(prog)s --model M --prompt-cache-file doc.safetensors --prompt "$(cat doc.txt)"
  python -m mlx_speculate.generate --prompt-cache-file doc.safetensors \\
      --prompt "Summarise the document above."

With a chat template the cached prompt is a user message left open, and the prompt given to
generate continues that message (mlx-lm's cache_prompt does the same). The file records the
model (a local folder as an absolute path), its compute dtype and the prompt's tokens; another
model or dtype reading it is an error. The file is written atomically."""


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog=cli.prog("mlx_speculate.cache_prompt"),
        description="Prefill a prompt once and save its cache, for generate to start from.",
        epilog=EXAMPLES,
    )
    cli.add_prompt_arguments(parser)
    parser.add_argument(
        "--prompt-cache-file", required=True, metavar="F", help="the file to save the cache in"
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="compute dtype of the model (default: float32 on the CPU, the checkpoint's on "
        "Metal); generate reads the file with the same",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = Path(args.prompt_cache_file)
    try:
        if path.is_dir():
            raise ValueError(f"--prompt-cache-file {path} is a folder, not a file")
        prompt = (
            cli.read_stdin("the prompt on stdin")
            if args.prompt == "-"
            else cli.utf8_argument(args.prompt, "--prompt")
        )
        system = cli.utf8_argument(args.system_prompt, "--system-prompt")
        model, tokenizer = load_or_default(args.model, args.dtype)
        tokens = open_user_message(tokenizer, prompt, system, not args.ignore_chat_template)
        started = time.perf_counter()
        cached = cache_prompt(model, tokens, name=_model_name(args.model))
        seconds = time.perf_counter() - started
        save_prompt_cache(path, model, cached)
    except KeyboardInterrupt:  # between prefill chunks: nothing is written
        return cli.INTERRUPTED
    except (ValueError, OSError, ImportError) as e:
        return cli.fail(e)
    size = path.stat().st_size / 1e6
    print(
        f"Cached {len(tokens)} prompt tokens in {path} ({size:.1f} MB; prefilled in "
        f"{seconds:.1f} s)",
        file=sys.stderr,
    )
    return 0


def _model_name(model: str | None) -> str:
    """What generate loads the file's model from: a local folder as an absolute path (the file
    may be read from another folder), a hub id as is, "" for the default model."""
    if model is None:
        return ""
    local = Path(model).expanduser()
    return str(local.resolve()) if local.exists() else model


if __name__ == "__main__":
    sys.exit(main())
