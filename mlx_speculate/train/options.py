"""Command-line flags described by dataclass fields: a field made by `option` carries its help,
and `add_options` / `given` turn the fields into flags and the flags given back into values.

A CLI built so never restates a default: the help shows the field's own (and a kind's, where
it differs), and only the flags given replace a field, so a default lives in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ..cli import non_negative_float, positive_int


def option(
    default: Any = None,
    help: str = "",
    *,
    flag: str | None = None,
    kinds: tuple[str, ...] | None = None,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    shown: str | None = None,
) -> Any:
    """A dataclass field that is also a flag: `--name-with-dashes` (or `flag`), parsed by
    `type` (default: from the annotation, ints >= 1 and floats >= 0), for `kinds` only
    (None: all); `shown` replaces the default in the help (for a None computed later)."""
    metadata = dict(help=help, flag=flag, kinds=kinds, type=type, choices=choices, shown=shown)
    return dataclasses.field(default=default, metadata=metadata)


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    kind_defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """A flag for every `option` field of `cls`; its help ends with the default, and with each
    kind's own default from `kind_defaults` (kind -> field -> value). A flag not given leaves
    no attribute: `given` returns only what was typed."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        m = f.metadata
        parse, many = _parser(hints[f.name])
        default = m["shown"] or ("none" if f.default is None else _show(f.default))
        kinds = (kind_defaults or {}).items()
        extra = [f"{k}: {_show(d[f.name])}" for k, d in kinds if f.name in d]
        shown = "; ".join(([default] if default else []) + extra)
        parser.add_argument(
            _flag(f),
            dest=f.name,
            metavar=_flag(f).removeprefix("--").replace("-", "_").upper(),
            type=m["type"] or parse,
            nargs="+" if many else None,
            choices=m["choices"],
            default=argparse.SUPPRESS,
            help=m["help"] + (f" (default: {shown})" if shown else ""),
        )


def given(args: argparse.Namespace, cls: type, kind: str) -> dict[str, Any]:
    """The `option` fields of `cls` whose flags were given, as field values; ValueError for a
    flag that does not apply to `kind`."""
    values = {}
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or not hasattr(args, f.name):
            continue
        kinds = f.metadata["kinds"]
        if kinds is not None and kind not in kinds:
            named = " and ".join([", ".join(kinds[:-1]), kinds[-1]] if kinds[1:] else kinds)
            raise ValueError(f"{_flag(f)} applies to {named}, not {kind}")
        value = getattr(args, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _parser(hint: Any) -> tuple[Callable[[str], Any], bool]:
    """(how one value is parsed, whether the flag takes several) for an annotation: int,
    float, str, a tuple of ints, or one of these or None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return {int: positive_int, float: non_negative_float}.get(hint, hint), False


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)
