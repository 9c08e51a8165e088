"""House rules on the package's code text: no measured timings in comments and docstrings (they
belong in commit messages, and go stale with every machine), and no `# fmt: skip` (a statement
squeezed onto one line to meet a line count hides a module that holds two concepts)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_speculate"

_NUMBER = r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?"
_UNIT = (
    r"(?:[mµun]s|s|secs?|seconds?|milliseconds?|microseconds?|min|mins|minutes?|hours?"
    r"|tok/s|tokens?/s|tokens? (?:per|a) second|steps?/s|it/s|[KMGT]i?B/s)"
)
# A measurement: a number with a unit of time or rate, a ratio of speeds, a before -> after
# pair of numbers, or the machine it was taken on.
MEASURED = re.compile(
    rf"{_NUMBER}\s?{_UNIT}(?![\w/])"
    rf"|{_NUMBER}\s?(?:x|×|times)\s+(?:faster|slower|quicker|as fast)\b"
    rf"|(?<![\w.])\d+\.\d+[x×](?!\w)"
    rf"|{_NUMBER}\s?%?\s*(?:->|→)\s*~?\d"
    r"|\b\d+-core\b|\b(?:EPYC|Xeon|M[1-4] (?:Pro|Max|Ultra))\b"
)
FMT_SKIP = re.compile(r"fmt:\s*(?:skip|off)\b")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _docstring_starts(tree: ast.Module) -> set[tuple[int, int]]:
    """(line, column) of each module, class and function docstring."""
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                starts.add((first.lineno, first.col_offset))
    return starts


def _code_text(path: Path, docstrings: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line) of the comments and (with `docstrings`) the docstrings of `path`."""
    source = path.read_text(encoding="utf-8")
    starts = _docstring_starts(ast.parse(source)) if docstrings else set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (
            token.type == tokenize.STRING and token.start in starts
        ):
            for i, line in enumerate(token.string.splitlines()):
                yield token.start[0] + i, line


def _offences(pattern: re.Pattern, docstrings: bool) -> list[str]:
    return [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in _modules()
        for n, line in _code_text(path, docstrings)
        if pattern.search(line)
    ]


@pytest.mark.parametrize(
    "text",
    [
        "short enough to cancel between (~1 s here)",
        "about 25 ns an element on a 2-core EPYC",
        "takes 36 instead of 220 ms",
        "511 -> 287 ms",
        "a chain-of-5 EAGLE step 2.94 -> 2.85 plain steps",
        "MLP: 162 -> 154 us",
        "held-out top-1 82.7 -> 85.1 %",
        "prefilled at ~6 tokens/s",
        "about 0.9 ms per row",
        "0.93 s against 0.77 s",
        "32 is 1.9x faster on SmolLM2",
        "about 45x slower than float32",
        "reads 12 GB/s",
        "reached 40 tok/s",
        "5 tokens per second",
        "about 6 min each",
        "13-20 ms against 2-4",
        "(measured on an M2 Max)",
    ],
)
def test_measured_pattern_catches(text):
    assert MEASURED.search(text), text


@pytest.mark.parametrize(
    "text",
    [
        "(B, L, D) queries over (B, Hk, S, D) keys",
        "2 ranks share one group",
        "64 rows",
        "a 4-bit matrix",
        "int32 positions",
        "two int32s",
        "the bit expansion is 8x the values",
        "98 MB written, against 538 MB in float32",
        "Local folder or hub id -> (model, tokenizer)",
        "per-32 scale and bias",
        "plus 0.1 x cross-entropy of the target's",
        "top-k >= 2",
        "1 + q_1 + q_1 q_2",
        "let us see",
        "python -m mlx_speculate.default_model",
        "layers 2, L//2 and L-3",
    ],
)
def test_measured_pattern_spares(text):
    assert not MEASURED.search(text), text


def test_no_measured_timing_in_code_text():
    """Comments and docstrings state the contract and one line of why; a measured figure goes
    in the commit message that made the change."""
    offences = _offences(MEASURED, docstrings=True)
    assert not offences, "measured figures in code text:\n" + "\n".join(offences)


def test_no_fmt_skip():
    """A statement is laid out as `ruff format` would; a module that grows past a few hundred
    lines is split by concept, not squeezed."""
    offences = _offences(FMT_SKIP, docstrings=False)
    assert not offences, "formatter markers in code text:\n" + "\n".join(offences)
