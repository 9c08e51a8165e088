"""Every command line starts light and explains itself: `--help` imports neither torch nor
transformers (mlx-lm's package imports both, so it is imported only where a model or a
tokenizer loads), and every option has help text that shows its default.

The commands are found, not listed: every module of the package that runs as
`python -m mlx_speculate.X` (a `__main__.py`, or a top-level `if __name__ == "__main__":`),
which covers pyproject's console scripts. How quick a start is belongs to benchmarks; what is
imported is what can be checked here without a clock."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_speculate"
HEAVY = ("torch", "transformers", "mlx_lm")


def runs_as_main(path: Path) -> bool:
    if path.name == "__main__.py":
        return True
    return any(
        isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
        for node in ast.parse(path.read_text()).body
    )


def command_modules() -> list[str]:
    """`mlx_speculate.X` for every `python -m mlx_speculate.X` (a package by its name)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if runs_as_main(path):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


COMMANDS = command_modules()


def console_scripts() -> dict[str, str]:
    """pyproject's [project.scripts]: name -> module:function."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', section, re.MULTILINE))


def test_the_commands_are_found():
    """The search has power: it finds the known commands and every console script."""
    assert {
        "mlx_speculate.generate",
        "mlx_speculate.convert",
        "mlx_speculate.server",
        "mlx_speculate.train",
        "mlx_speculate.calibrate",
        "mlx_speculate.default_model",
    } <= set(COMMANDS)
    scripts = console_scripts()
    assert len(scripts) >= 3
    for target in scripts.values():
        module = target.split(":")[0].removesuffix(".__main__")
        assert module in COMMANDS, target


HELP_PROBE = """
import json, runpy, sys
sys.argv = [{module!r}, "--help"]
try:
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
except SystemExit as e:
    status = e.code
else:
    status = None
heavy = [name for name in {heavy!r} if name in sys.modules]
print(json.dumps({{"status": status, "heavy": heavy}}), file=sys.stderr)
"""


@pytest.mark.parametrize("module", COMMANDS)
def test_help_imports_neither_torch_nor_transformers(module):
    """In a fresh interpreter, as `python -m` runs it: `--help` prints the usage, exits 0,
    and leaves torch, transformers and mlx_lm unimported."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_PROBE.format(module=module, heavy=HEAVY)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.stdout.startswith("usage: "), done.stderr
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"status": 0, "heavy": []}, f"{module} --help imported {report['heavy']}"


class _Parsed(Exception):
    """Raised by the patched `parse_args` with the parser it was called on."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `main()` builds, caught when it parses (so inline parsers count too)."""

    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    target = importlib.import_module(
        f"{module}.__main__" if (ROOT / module.replace(".", "/")).is_dir() else module
    )
    with pytest.raises(_Parsed) as parsed:
        target.main([])
    return parsed.value.parser


def takes_a_default(action: argparse.Action) -> bool:
    """An option that takes a value and may be left out: what a user must see the default of."""
    return bool(action.option_strings) and action.nargs != 0 and not action.required


@pytest.mark.parametrize("module", COMMANDS)
def test_every_option_is_described_with_its_default(module, monkeypatch):
    parser = parser_of(module, monkeypatch)
    formatter = parser._get_formatter()
    undescribed, no_default = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = formatter._expand_help(action) if action.help else ""
        if not text.strip() or action.help == argparse.SUPPRESS:
            undescribed.append(name)
        elif takes_a_default(action) and "default" not in text:
            no_default.append(name)
    assert undescribed == [], f"{module}: options without help"
    assert no_default == [], f"{module}: options whose help hides the default"
    parser.format_help()  # every help string formats (a stray % would raise here)


def test_the_formatter_shows_each_kind_of_default():
    from mlx_speculate import cli

    parser = cli.ArgumentParser(prog="p")
    parser.add_argument("--port", type=int, default=8080, help="port")
    parser.add_argument("--seed", type=int, help="seed")
    parser.add_argument("--model", help="model (default: the default model)")
    parser.add_argument("--fast", action="store_true", help="go fast")
    parser.add_argument("--out", required=True, help="where")
    text = " ".join(parser.format_help().split())
    assert "port (default: 8080)" in text
    assert "seed (default: none)" in text
    assert "model (default: the default model)" in text and "the default model) (" not in text
    assert "go fast" in text and "go fast (default" not in text
    assert "where" in text and "where (default" not in text
